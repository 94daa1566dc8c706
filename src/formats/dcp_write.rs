//! The DCP writer at its older path: see [`super::dcp::write`].

pub use super::dcp::write::*;
