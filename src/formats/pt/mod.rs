//! One `torch.save` file (`.pt`) holding a state dict, read as a one-rank checkpoint
//! ([`read`]: flattening `data.pkl` into flat keys as DCP does) and written so that
//! `torch.load(path, weights_only=True)` opens it (`write.rs`, [`write()`]: the nested dict
//! rebuilt from the flat keys). The container, pickles and tensor rebuild calls are
//! [`super::torch`]'s.

mod codec;
pub mod read;
mod write;

pub use codec::Pt;
pub use write::write;

use crate::layout::{DType, Loc, Piece, Region, TensorLayout};

/// The layout of a tensor held whole by file 0 of rank 0, its element 0 at `offset`
/// (`strides` when the saved view is not row-major).
fn whole_tensor(
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    offset: u64,
    strides: Option<Vec<u64>>,
) -> TensorLayout {
    TensorLayout {
        name,
        dtype,
        pieces: vec![Piece {
            rank: 0,
            region: Region::full(&shape),
            loc: Loc {
                file: 0,
                offset,
                strides,
                pending: None,
            },
        }],
        shape,
    }
}
