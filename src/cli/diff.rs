//! `reshard diff`: two checkpoints compared tensor by tensor (and non-tensor entries by
//! value); a difference is the command's finding (exit status 1, the differences on standard
//! output and one summary line without `error` on standard error), not an error.

use super::text::{clip, json, shown};
use super::Outcome;
use crate::diff::{Diff, Difference};
use crate::formats::Checkpoint;
use crate::Result;
use std::io::{self, Write};
use std::path::Path;

/// Compare `a` with `b` and print what differs to `out`.
pub fn run(a: &Path, b: &Path, as_json: bool, out: &mut dyn Write) -> Result<Outcome> {
    let ca = Checkpoint::open(a)?;
    let cb = Checkpoint::open(b)?;
    let d = crate::diff::diff(&ca, &cb)?;
    shown(if as_json {
        json(out, &d)
    } else {
        print(out, a, b, &d)
    })?;
    Ok(if d.is_equal() {
        Outcome::Clean
    } else {
        Outcome::Differ(format!(
            "{} and {} differ: {} difference(s)",
            a.display(),
            b.display(),
            d.differences.len()
        ))
    })
}

/// One line per difference, then a summary line.
fn print(out: &mut dyn Write, a: &Path, b: &Path, d: &Diff) -> io::Result<()> {
    for (name, x) in &d.differences {
        writeln!(out, "{name}: {}", describe(x, a, b))?;
    }
    writeln!(
        out,
        "compared {} tensor(s) and {} non-tensor entr{}: {}",
        d.tensors,
        d.entries,
        if d.entries == 1 { "y" } else { "ies" },
        if d.is_equal() {
            "identical".to_string()
        } else {
            format!("{} difference(s)", d.differences.len())
        }
    )
}

/// What differs, in words (`a` and `b` name the checkpoints).
fn describe(x: &Difference, a: &Path, b: &Path) -> String {
    use Difference as D;
    match x {
        D::OnlyInA => format!("only in {}", a.display()),
        D::OnlyInB => format!("only in {}", b.display()),
        D::Shape { a, b } => format!("shape {a:?} vs {b:?}"),
        D::DType { a, b } => format!("dtype {a} vs {b}"),
        D::Bytes { elements, first } => {
            format!("{elements} element(s) differ, the first at flat index {first}")
        }
        D::Values {
            a,
            b,
            max_abs,
            max_rel,
        } => format!(
            "dtype {a} vs {b}: max abs difference {max_abs:e}, max rel difference {max_rel:e}"
        ),
        D::Value { a, b } if a == b => format!(
            "value {} vs {} (of different types, or contents JSON does not show)",
            clip(&a.to_string(), 60),
            clip(&b.to_string(), 60)
        ),
        D::Value { a, b } => format!(
            "value {} vs {}",
            clip(&a.to_string(), 60),
            clip(&b.to_string(), 60)
        ),
    }
}
