//! Output plumbing shared by the commands: sizes, column widths and clipping for the tables,
//! turning a failed write to standard output into an error (or into nothing, when the reader
//! closed the pipe early), and lines to standard error.

use crate::{Error, Result};
use bytesize::ByteSize;
use std::io::{self, Write};

/// `n` bytes in binary units: `512 B`, `20.7 KiB`, `1.0 MiB`.
pub fn size(n: u64) -> String {
    ByteSize(n).display().iec().to_string()
}

/// `v` as pretty-printed JSON, with a final newline.
pub fn json(out: &mut dyn Write, v: &impl serde::Serialize) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v)?;
    writeln!(out)
}

/// Width of a name column: the longest name, at least 6.
pub fn name_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(str::len).max().unwrap_or(6).max(6)
}

/// `s` cut to `n` characters, with an ellipsis when cut.
pub fn clip(s: &str, n: usize) -> String {
    if s.chars().count() > n {
        format!("{}…", s.chars().take(n).collect::<String>())
    } else {
        s.to_string()
    }
}

/// The outcome of writing standard output: a reader that closed the pipe early (`| head`)
/// wanted no more, which is no error; any other failure is one naming standard output.
pub fn shown(written: io::Result<()>) -> Result<()> {
    match written {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(Error::Io {
            path: "standard output".into(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Write `reshard: {what}` as one line to standard error. A failure to do so is ignored:
/// there is nowhere left to report it.
pub fn complain(what: &str) {
    let _ = writeln!(io::stderr().lock(), "reshard: {}", what.replace('\n', " "));
}
