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

/// Input-derived text for a message: escaped, at most 60 characters after escaping (control
/// characters escape to up to 10 each, so the cut is made on the escaped text).
pub fn short(text: &str) -> String {
    const MAX: usize = 60;
    let mut out = String::new();
    let mut width = 0;
    for c in text.chars() {
        let escaped = c.escape_debug();
        let n = escaped.len();
        if width + n > MAX {
            out.push('…');
            break;
        }
        width += n;
        out.extend(escaped);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::short;

    #[test]
    fn short_bounds_the_escaped_text() {
        assert_eq!(short("torch.FloatStorage"), "torch.FloatStorage");
        let s = short(&"\u{2}".repeat(100));
        assert!(s.chars().count() <= 61, "{s}");
        assert!(s.ends_with('…'));
        let exact = "a".repeat(60);
        assert_eq!(short(&exact), exact);
        assert_eq!(short(&"a".repeat(61)), format!("{}…", "a".repeat(60)));
    }
}
