//! The crate's error type: one line per problem, naming the file or tensor concerned.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in reshard. `Display` is a single line meant for people; it
/// names no command-line flag, so that every front end can add its own [`Hint`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O error on a named file.
    #[error("{}: {source}", one_line(&path.display().to_string()))]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file whose content is not what its format promises.
    #[error("{}: {}", one_line(&path.display().to_string()), one_line(msg))]
    Format {
        /// The file involved.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A tensor layout that does not describe the tensor exactly (gap, overlap, out of bounds).
    #[error("tensor `{}`: {}", one_line(tensor), one_line(msg))]
    Layout {
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        msg: String,
    },
    /// A request that cannot be carried out as asked (bad option, refused cast, existing output).
    #[error("{}", one_line(.0))]
    Usage(String),
    /// A request that a different setting would allow; [`Hint`] says which.
    #[error("{}", one_line(msg))]
    Refused {
        /// What is wrong.
        msg: String,
        /// The setting that would allow it.
        hint: Hint,
    },
    /// An output format asked to hold more ranks than it can.
    #[error("{noun} holds {}, not {world}", if *max == 1 { "one rank".to_string() } else { format!("at most {max} ranks") })]
    TooManyRanks {
        /// The format's name.
        format: &'static str,
        /// How the format is named in a sentence (`a .pt file`).
        noun: &'static str,
        /// The most ranks it holds.
        max: u32,
        /// The ranks asked for.
        world: u64,
    },
    /// A bug in reshard: a state its own checks should have made impossible. Not the
    /// input's fault nor the caller's; front ends ask for a report.
    #[error("internal error: {} (a bug in reshard: please report it)", one_line(.0))]
    Internal(String),
}

/// The setting that would let a [`Error::Refused`] (or [`Error::TooManyRanks`]) request
/// through, for front ends to word as their own flag or argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Hint {
    /// Replace an existing destination.
    Force,
    /// Say what to do with per-rank state (drop it, or keep rank 0's).
    PerRankState,
    /// Ask for fewer target ranks, or an output format that holds more.
    WorldSize,
    /// Name which of the checkpoints a folder holds to open (a DeepSpeed tag, a step folder).
    Tag,
    /// Leave the output format to the destination's name, which asks for one file with this
    /// extension (`pt`).
    FormatFromName(&'static str),
    /// Ask for this folder format (its name), writing to a folder.
    FolderFormat(&'static str),
}

/// `text` with its control characters (newlines, carriage returns, terminal escapes) written
/// as Rust escapes (`\n`), so that names taken from a file cannot break a message over lines.
pub fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A format error on `path`.
    pub fn format(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.as_ref().to_path_buf(),
            msg: msg.into(),
        }
    }

    /// A layout error on tensor `tensor`.
    pub fn layout(tensor: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Layout {
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }

    /// A usage error.
    pub fn usage(msg: impl Into<String>) -> Self {
        Error::Usage(msg.into())
    }

    /// A bug in reshard ([`Error::Internal`]).
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }

    /// A request that `hint`'s setting would allow.
    pub fn refused(msg: impl Into<String>, hint: Hint) -> Self {
        Error::Refused {
            msg: msg.into(),
            hint,
        }
    }

    /// The setting that would let this request through, if any.
    pub fn hint(&self) -> Option<Hint> {
        match self {
            Error::Refused { hint, .. } => Some(*hint),
            Error::TooManyRanks { .. } => Some(Hint::WorldSize),
            _ => None,
        }
    }
}

/// Attach a path to `std::io::Result`s.
pub trait IoContext<T> {
    /// Turn an I/O error into [`Error::Io`] naming `path`.
    fn at(self, path: impl AsRef<Path>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl AsRef<Path>) -> Result<T> {
        self.map_err(|source| Error::Io {
            path: path.as_ref().to_path_buf(),
            source,
        })
    }
}
