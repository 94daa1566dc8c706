//! Reading one `torch.save` zip archive held in a byte slice, at its older path: the container
//! is [`super::torch::zip`], the tensors and `data.pkl` are [`super::torch::save`].

pub(crate) use super::torch::save::tensor_of;
pub use super::torch::save::{parse, torch_dtype, Item, TensorItem};
pub(crate) use super::torch::short;
pub use super::torch::zip::{Archive, Entry, RecordSpan as Record, TorchZipError};
