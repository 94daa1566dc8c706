//! Writing `torch.save` archives that `torch.load(path, weights_only=True)` accepts, at its
//! older path: the pickle writer is [`super::torch::pickle`] (`write.rs`), the archive
//! layout [`super::torch::zip`], tensors and the standard records [`super::torch::save`],
//! dtype names [`super::torch::dtype`].

pub use super::torch::dtype::{legacy_storage, torch_dtype_name};
pub use super::torch::pickle::write::{
    from_json, from_pickle, is_allowed_global, pickle, pickle_checked, validate, validate_torch21,
    PyValue, MAX_DEPTH,
};
pub use super::torch::save::{contiguous_strides, save_to_vec, standard_records, TensorRef};
pub use super::torch::zip::{
    archive_bytes, crc_offsets, fill_crcs, layout_archive, output_parts, ArchiveLayout,
    EntryLayout, Record, ALIGNMENT,
};
