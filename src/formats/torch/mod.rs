//! The `torch.save` family of formats: everything PyTorch's own serialization is made of, read
//! and written in one place (`docs/pytorch-formats.md` §2–3, §8).
//!
//! - [`dtype`]: the one table of torch dtypes (names, aliases, legacy storage classes);
//! - [`pickle`]: Python pickles — the opcode table ([`pickle::op`]), the safe reader (DCP
//!   `.metadata`, `data.pkl`) and the weights-only-safe writer ([`pickle::PyValue`]);
//! - [`zip`]: the zip container of `torch.save` archives — binary records as named structs,
//!   reading an archive's directory, laying out and writing archives as torch does;
//! - [`save`]: `torch.save` archives themselves — tensor rebuild calls (read and written), the
//!   records torch writes, whole-archive parsing.
//!
//! The checkpoint formats built on them live beside this module: [`super::dcp`] (Distributed
//! Checkpoints, read and written) and [`super::pt`] (one `.pt` file, read and written).

pub mod dtype;
pub mod pickle;
pub mod save;
pub mod zip;

/// Input-derived text for a message: escaped, at most 60 characters.
pub(crate) fn short(text: &str) -> String {
    const MAX: usize = 60;
    let mut out: String = text
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(MAX).is_some() {
        out.push('…');
    }
    out
}
