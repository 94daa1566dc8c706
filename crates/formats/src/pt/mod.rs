//! One `torch.save` file (`.pt`) holding a state dict, read as a one-rank checkpoint
//! ([`read`]: flattening `data.pkl` into flat keys as DCP does) and written so that
//! `torch.load(path, weights_only=True)` opens it (`write.rs`, [`write()`]: the nested dict
//! rebuilt from the flat keys). The container, pickles and tensor rebuild calls are
//! [`super::torch`]'s.

mod codec;
pub mod read;
mod write;

pub use codec::Pt;
pub(crate) use write::nested_values;
pub use write::write;
