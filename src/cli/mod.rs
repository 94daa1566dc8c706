//! The `reshard` command: the command-line face of the library, behind the `cli` feature so
//! that the binary and the Python package's `reshard` command run the same code. Parsing and
//! printing only; every decision is made in the library.
//!
//! This file owns dispatch and the exit status, as diff(1) and ripgrep use it: 0 when all is
//! well, 1 when `diff` finds a difference or `verify` a corrupt record, 2 for every error
//! (bad usage, a checkpoint that cannot be read, a failed write, an internal error). Every
//! error is one `reshard: error: …` line on standard error; a difference `diff` finds is no
//! error: its summary line (`reshard: A and B differ: N difference(s)`) has no `error:`. A reader
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
/// Exit status of every error, usage errors clap finds included.
const TROUBLE: u8 = 2;

/// What a command that ran to the end concluded.
pub enum Outcome {
    /// Nothing to report.
    Clean,
    /// What `verify` looks for (damage) was found; the message says what (one line, printed
    /// as an error).
    Found(String),
    /// What `diff` looks for (a difference) was found, which is no error: the message is the
    /// summary line, printed as it is.
    Differ(String),
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

/// A command line clap does not run: the help and the version are printed as clap prints
/// them, with its status (0; 2 for the help shown in place of a missing command); an error
/// (an unknown flag, a missing argument, a bad value) is one `reshard: error: …` line, status
/// 2, as every other error ([`usage_line`]).
fn refused(e: clap::Error) -> u8 {
    use clap::error::ErrorKind as K;
    if matches!(
        e.kind(),
        K::DisplayHelp | K::DisplayVersion | K::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = e.print();
        return u8::try_from(e.exit_code()).unwrap_or(TROUBLE);
    }
    text::complain(&format!("error: {}", usage_line(&e.render().to_string())));
    TROUBLE
}

/// clap's error text (`error: MESSAGE`, its tips and the usage, in paragraphs over several
/// lines) as one line: the message, then `; tip: …` and `; usage: …`. The pointer to `--help`
/// is left out.
fn usage_line(text: &str) -> String {
    let mut parts: Vec<String> = text
        .split("\n\n")
        .map(|p| {
            p.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|p| !p.is_empty() && !p.starts_with("For more information"))
        .collect();
    for p in &mut parts {
        if let Some(rest) = p.strip_prefix("error: ") {
            *p = rest.to_string();
        } else if let Some(rest) = p.strip_prefix("Usage: ") {
            *p = format!("usage: {rest}");
        }
    }
    parts.join("; ")
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
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return refused(e),
    };
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
        Ok(Ok(Outcome::Differ(summary))) => {
            text::complain(&summary);
            return FOUND;
        }
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
