//! DeepSpeed ZeRO checkpoints, stages 1, 2 and 3, read and written without DeepSpeed or
//! Python.
//!
//! A checkpoint folder holds `latest` (the newest tag) and a folder per tag:
//!
//! | file | stage | holds |
//! |---|---|---|
//! | `mp_rank_00_model_states.pt` | 1, 2 | `module` (the model's state dict, model dtype), `param_shapes`, `buffer_names`, `shared_params`, `frozen_param_*`, engine counters, `ds_config`, client state |
//! | `zero_pp_rank_<r>_mp_rank_00_model_states.pt` | 3 | the same per rank; parameters in `module` are empty placeholders, frozen ones in `frozen_param_fragments` |
//! | `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` | all | rank r's fp32 master partition of each flat group and the wrapped optimizer's state over it |
//!
//! Every file is a `torch.save` archive; its pickle names DeepSpeed's classes (loss scaler,
//! `ZeroStageEnum`, `fragment_address`), which the allow-listed reader decodes into plain
//! values ([`records::plain`]) without importing anything. Where each parameter's elements sit
//! is `partition`'s arithmetic; the reader (`read`) turns it into flat-range layouts and the
//! writer (`write`) lays a target out the way DeepSpeed's engine at another degree would
//! save it. Universal checkpoints (`ds_to_universal`'s per-parameter files) are
//! [`universal`]'s, a format of their own.

mod codec;
mod names;
pub mod partition;
pub mod read;
pub mod records;
pub mod universal;
mod write;

pub use codec::DeepSpeed;
pub use universal::Universal;
