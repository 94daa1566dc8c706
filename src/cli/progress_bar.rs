//! The CLI's progress bar: an indicatif bar on stderr behind the library's
//! [`crate::Progress`]. Part of the binary only, so
//! the library does not depend on indicatif.

use crate::Progress;

/// A bar of destination bytes written, with rate and ETA, drawn on stderr (only when it is a
/// terminal) and cleared when the run finishes.
pub struct Bar(indicatif::ProgressBar);

impl Bar {
    /// A bar not drawn until the run starts.
    pub fn new() -> Self {
        let b =
            indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Bar(b)
    }
}

impl Progress for Bar {
    fn start(&self, total_bytes: u64) {
        self.0.set_length(total_bytes);
        self.0.reset();
    }

    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
}
