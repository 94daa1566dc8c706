//! The crate's error type: one line per problem, naming the file or tensor concerned.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in reshard. `Display` is a single line meant for people.
#[derive(Debug, thiserror::Error)]
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
}

/// `text` with its control characters (newlines, carriage returns, terminal escapes) written
/// as Rust escapes (`\n`), so that names taken from a file cannot break a message over lines.
pub(crate) fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
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
