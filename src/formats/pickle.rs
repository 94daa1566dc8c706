//! The pickle reader's items at their older path: see [`super::torch::pickle`].

pub use super::torch::pickle::*;
