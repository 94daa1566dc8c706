//! The `.pt` reader at its older path: see [`super::pt::read`].

pub use super::pt::read::{is_legacy, read};
