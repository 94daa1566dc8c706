//! The `reshard` command: the command-line face of the library, behind the `cli` feature so
//! that the binary and the Python package's `reshard` command run the same code. Parsing and
//! printing only; every decision is made in the library.
//!
//! This file owns dispatch and the exit status, as diff(1) and ripgrep use it: 0 when all is
//! well, 1 when `diff` finds a difference or `verify` a corrupt record, 2 for every error
//! (bad usage, a checkpoint that cannot be read, a failed write, an internal error). A reader
//! that closes standard output early (`reshard inspect ck | head -1`) changes nothing: the
//! rest of the output is dropped quietly and the status is what it would have been.

mod args;
mod convert;
mod diff;
mod inspect;
mod plan;
mod progress_bar;
mod text;
mod verify;

use crate::Result;
use args::{Cli, Cmd};
use clap::Parser;
use std::io::{self, BufWriter, Write};

/// Exit status of a `diff` that found a difference or a `verify` that found damage.
const FOUND: u8 = 1;
/// Exit status of every error (clap's usage errors exit with it too).
const TROUBLE: u8 = 2;

/// What a command that ran to the end concluded.
pub enum Outcome {
    /// Nothing to report.
    Clean,
    /// What `diff` or `verify` looks for was found; the message says what (one line).
    Found(String),
}

/// Run the command `cli` names, writing its output to `out`.
fn run(cli: Cli, out: &mut dyn Write) -> Result<Outcome> {
    match cli.cmd {
        Cmd::Inspect { path, source, json } => inspect::run(&path, &source.options(), json, out),
        Cmd::Plan {
            src,
            dst,
            source,
            target,
            ops,
            json,
        } => plan::run(
            &src,
            dst.as_deref(),
            &source.options(),
            &target,
            ops,
            json,
            out,
        ),
        Cmd::Convert {
            src,
            dst,
            source,
            target,
            flags,
        } => convert::run(&src, &dst, &source.options(), &target, &flags, out),
        Cmd::Commit {
            dst,
            force,
            no_verify,
            staging,
            quiet,
        } => convert::commit(&dst, staging.as_deref(), force, !no_verify, quiet, out),
        Cmd::Verify {
            path,
            source,
            json,
            read,
        } => verify::run(
            &path,
            &source.options(),
            read.unwrap_or_default(),
            json,
            out,
        ),
        Cmd::Diff { a, b, json } => diff::run(&a, &b, json, out),
    }
}

/// The message of a panic's payload, when it has one.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Run the command line `args` (the program name first, as `std::env::args_os` gives it)
/// and return the exit status (0, 1 or 2). Prints to standard output and standard error.
pub fn main<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    // A file over `ulimit -f` must fail its write with EFBIG (reported, staging removed), not
    // kill the process with SIGXFSZ.
    // SAFETY: SIG_IGN installs no handler, so no code runs on the signal; changing a
    // disposition is sound with other threads running (the Python command calls this too).
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let cli = Cli::parse_from(args);
    if let Some(url) = &cli.endpoint_url {
        crate::remote::set_endpoint_url(url);
    }
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<Outcome> {
        // Not locked: a line printed from another thread must not wait for the command to end.
        let mut out = BufWriter::new(io::stdout());
        let outcome = run(cli, &mut out)?;
        text::shown(out.flush())?;
        Ok(outcome)
    }));
    let (status, msg) = match result {
        Ok(Ok(Outcome::Clean)) => return 0,
        Ok(Ok(Outcome::Found(msg))) => (FOUND, msg),
        Ok(Err(e)) => (TROUBLE, format!("{e}{}", args::hint(&e))),
        Err(payload) => (
            TROUBLE,
            format!(
                "internal error: {} (please report it)",
                panic_message(payload.as_ref())
            ),
        ),
    };
    text::complain(&format!("error: {msg}"));
    status
}
