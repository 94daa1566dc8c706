//! The M optim files: each rank's fp32 master partitions, the wrapped optimizer's state and
//! parameter groups over the flat tensors, and the ZeRO wrapper's records (loss scaler,
//! paddings, partition counts, `param_slice_mappings`).

use super::super::names;
use super::super::partition::FlatGroup;
use super::super::records::{FRAGMENT_ADDRESS, ZERO_STAGE_ENUM};
use super::archive::{int, s, At, Out, Place};
use super::flats::Flat;
use super::job::Kind;
use super::{needs, Writer};
use crate::error::{Error, Result};
use crate::layout::DType;
use crate::torch::pickle::PyValue;
use crate::torch::short;
use std::collections::{HashMap, HashSet};

/// How each parameter state key is kept: per element, or one per flat tensor.
#[derive(Clone)]
pub(super) enum StateKind {
    Flat(DType),
    Scalar(DType),
}

/// A parameter's optimizer state entries: per key, a target tensor or a value.
#[derive(Clone, Default)]
pub(super) struct ParamState {
    pub(super) tensors: Vec<(String, usize)>,
    pub(super) values: Vec<(String, PyValue)>,
}

impl Writer<'_> {
    /// The M optim files: the fp32 master partitions and the optimizer state of every flat
    /// tensor, and the wrapper's scalars.
    pub(super) fn optim_files(
        &mut self,
        dir: &std::path::Path,
        flats: &[Flat],
        state: &HashMap<String, ParamState>,
    ) -> Result<()> {
        let job = self.job;
        let target = self.target;
        // each flat tensor's state: the keys of its first parameter, which all must share
        let mut flat_state: Vec<Vec<(String, StateKind, usize)>> = vec![];
        let mut flat_values: Vec<Vec<(String, PyValue)>> = vec![];
        for f in flats {
            // (a group without trainable parameters has a flat tensor without state)
            let first = f
                .params
                .first()
                .and_then(|p| state.get(&p.0))
                .cloned()
                .unwrap_or_default();
            let mut keys = vec![];
            for (k, i) in &first.tensors {
                let t = &target[*i];
                let kind = if t.shape.is_empty() {
                    StateKind::Scalar(t.dtype)
                } else {
                    StateKind::Flat(t.dtype)
                };
                keys.push((k.clone(), kind, *i));
            }
            for (name, shape, _) in &f.params {
                let ps = state.get(name).cloned().unwrap_or_default();
                let have: HashSet<&str> = ps.tensors.iter().map(|(k, _)| k.as_str()).collect();
                let want: HashSet<&str> = keys.iter().map(|(k, _, _)| k.as_str()).collect();
                if have != want {
                    return Err(needs(format!(
                        "needs the same optimizer state keys for every parameter of a group: \
                         `{}` has {:?}, `{}` {:?}",
                        short(&f.params[0].0),
                        sorted(&want),
                        short(name),
                        sorted(&have)
                    )));
                }
                for (k, i) in &ps.tensors {
                    let t = &target[*i];
                    let flat = keys.iter().find(|(key, _, _)| key == k);
                    if let Some((_, StateKind::Flat(d), _)) = flat {
                        if &t.shape != shape || t.dtype != *d {
                            return Err(Error::layout(
                                &t.name,
                                format!(
                                    "is {} {:?}; a parameter's `{k}` must be {d} of its shape {shape:?}",
                                    t.dtype, t.shape
                                ),
                            ));
                        }
                    } else if !t.shape.is_empty() {
                        return Err(Error::layout(
                            &t.name,
                            "must be a scalar, as the group's first parameter's",
                        ));
                    }
                }
            }
            flat_state.push(keys);
            flat_values.push(first.values);
        }
        let groups = job.groups.len();
        let mut fp32: Vec<Vec<At>> = vec![vec![]; flats.len()];
        // per flat tensor and state key: the storage of each rank
        let mut state_at: Vec<Vec<Vec<At>>> = flat_state
            .iter()
            .map(|keys| vec![vec![]; keys.len()])
            .collect();
        let bf16_files = job.model_dtype == DType::BF16;
        for r in 0..self.m {
            let file = self.archive(dir.join(names::optim_states(r, bf16_files)));
            // the wrapped optimizer's state dict over the flat tensors
            let mut st = vec![];
            for (fi, f) in flats.iter().enumerate() {
                let mut entries = vec![];
                for (ki, (k, kind, _)) in flat_state[fi].iter().enumerate() {
                    let (v, at) = match kind {
                        StateKind::Scalar(d) => self.tensor(file, *d, vec![]),
                        StateKind::Flat(d) => self.tensor(file, *d, vec![f.len]),
                    };
                    state_at[fi][ki].push(at);
                    entries.push((s(k), v));
                }
                for (k, v) in &flat_values[fi] {
                    entries.push((s(k), v.clone()));
                }
                st.push((int(fi as u64), PyValue::Dict(entries)));
            }
            let param_groups = (0..groups)
                .map(|g| {
                    let mut d: Vec<(PyValue, PyValue)> = job.hyper[g]
                        .iter()
                        .map(|(k, v)| (s(k), v.clone()))
                        .collect();
                    let ids = flats
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| f.group == g)
                        .map(|(i, _)| int(i as u64))
                        .collect();
                    d.push((s("params"), PyValue::List(ids)));
                    PyValue::Dict(d)
                })
                .collect();
            let base = PyValue::Dict(vec![
                (s("state"), PyValue::Dict(st)),
                (s("param_groups"), PyValue::List(param_groups)),
            ]);
            // the fp32 master weights
            let mut masters = vec![];
            for (fi, f) in flats.iter().enumerate() {
                let len = match (&f.layout, job.kind) {
                    (Some(l), Kind::Zero12(_)) => f.len - l.rank_padding(r),
                    _ => f.len,
                };
                let (v, at) = self.tensor(file, DType::F32, vec![len]);
                fp32[fi].push(at);
                masters.push(v);
            }
            let osd = match job.kind {
                Kind::Zero3 => PyValue::Dict(vec![
                    (s("zero_stage"), zero_stage(3)),
                    (s("loss_scaler"), job.loss_scaler()),
                    (
                        s("dynamic_loss_scale"),
                        job.scalar("dynamic_loss_scale", PyValue::Bool(false)),
                    ),
                    (s("overflow"), job.scalar("overflow", PyValue::Bool(false))),
                    (s("partition_count"), int(self.m)),
                    (s("optimizer_state_dict"), base),
                    (s("fp32_flat_groups"), PyValue::List(masters)),
                ]),
                Kind::Zero12(stage) => {
                    let layouts: Vec<&FlatGroup> =
                        flats.iter().filter_map(|f| f.layout.as_ref()).collect();
                    PyValue::Dict(vec![
                        (s("loss_scaler"), job.loss_scaler()),
                        (
                            s("dynamic_loss_scale"),
                            job.scalar("dynamic_loss_scale", PyValue::Bool(false)),
                        ),
                        (s("overflow"), job.scalar("overflow", PyValue::Bool(false))),
                        (s("clip_grad"), job.scalar("clip_grad", PyValue::Float(1.0))),
                        (s("base_optimizer_state"), base),
                        (s("single_partition_of_fp32_groups"), PyValue::List(masters)),
                        (s("zero_stage"), zero_stage(stage)),
                        (
                            s("group_paddings"),
                            PyValue::List(layouts.iter().map(|l| int(l.rank_padding(r))).collect()),
                        ),
                        (
                            s("param_alignment_paddings"),
                            PyValue::List(
                                layouts
                                    .iter()
                                    .map(|l| {
                                        PyValue::List(l.paddings.iter().map(|&p| int(p)).collect())
                                    })
                                    .collect(),
                            ),
                        ),
                        (
                            s("partition_count"),
                            PyValue::List(vec![int(self.m); groups]),
                        ),
                        (s("ds_version"), job.ds_version.clone()),
                        (s("param_slice_mappings"), slice_mappings(flats, r)),
                    ])
                }
                Kind::Bf16 => {
                    let pads = flats
                        .iter()
                        .map(|f| {
                            let real: u64 = f.layout.as_ref().map_or(0, |l| l.numels.iter().sum());
                            int(if r + 1 == self.m {
                                f.len * self.m - real
                            } else {
                                0
                            })
                        })
                        .collect();
                    PyValue::Dict(vec![
                        (s("clip_grad"), job.scalar("clip_grad", PyValue::Float(1.0))),
                        (s("base_optimizer_state"), base),
                        (s("single_partition_of_fp32_groups"), PyValue::List(masters)),
                        (s("group_paddings"), PyValue::List(pads)),
                        (
                            s("partition_count"),
                            PyValue::List(vec![int(self.m); groups]),
                        ),
                        (s("ds_version"), job.ds_version.clone()),
                        (s("param_slice_mappings"), slice_mappings(flats, r)),
                    ])
                }
            };
            let top = PyValue::Dict(vec![
                (s("optimizer_state_dict"), osd),
                (s("ds_config"), self.config()),
                (s("ds_version"), job.ds_version.clone()),
            ]);
            self.values.push(top);
        }
        // parameters and their state over the rank files
        for (fi, f) in flats.iter().enumerate() {
            for (name, shape, spans) in &f.params {
                self.outs.push(Out {
                    name: name.clone(),
                    dtype: DType::F32,
                    shape: shape.clone(),
                    place: Place::Flat(spans.clone(), fp32[fi].clone()),
                });
            }
            for (ki, (k, kind, first)) in flat_state[fi].iter().enumerate() {
                match kind {
                    StateKind::Scalar(d) => self.outs.push(Out {
                        // the group's first parameter's value stands for the flat tensor
                        name: target[*first].name.clone(),
                        dtype: *d,
                        shape: vec![],
                        place: Place::Whole(state_at[fi][ki].clone()),
                    }),
                    StateKind::Flat(d) => {
                        for (name, shape, spans) in &f.params {
                            let ps = &state[name];
                            let i = ps
                                .tensors
                                .iter()
                                .find(|(key, _)| key == k)
                                .map(|(_, i)| *i)
                                .expect("keys checked equal");
                            self.outs.push(Out {
                                name: target[i].name.clone(),
                                dtype: *d,
                                shape: shape.clone(),
                                place: Place::Flat(spans.clone(), state_at[fi][ki].clone()),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

pub(super) fn zero_stage(stage: u8) -> PyValue {
    PyValue::Call {
        module: ZERO_STAGE_ENUM.0.into(),
        name: ZERO_STAGE_ENUM.1.into(),
        args: vec![PyValue::Int(stage as i64)],
    }
}

/// `param_slice_mappings` of rank `r`: per group, each parameter with elements in the rank's
/// partition → `fragment_address(numel, start)` (its run's length and place in the
/// partition).
pub(super) fn slice_mappings(flats: &[Flat], r: u64) -> PyValue {
    PyValue::List(
        flats
            .iter()
            .map(|f| {
                PyValue::OrderedDict(
                    f.mapping_order
                        .iter()
                        .map(|&i| (&f.params[i].0, &f.recorded[i]))
                        .filter_map(|(n, spans)| {
                            let sp = spans.iter().find(|s| s.rank == r)?;
                            Some((
                                s(n),
                                PyValue::Object {
                                    module: FRAGMENT_ADDRESS.0.into(),
                                    name: FRAGMENT_ADDRESS.1.into(),
                                    state: Some(Box::new(PyValue::Dict(vec![
                                        (s("numel"), int(sp.end - sp.start)),
                                        (s("start"), int(sp.at)),
                                    ]))),
                                },
                            ))
                        })
                        .collect(),
                )
            })
            .collect(),
    )
}

pub(super) fn sorted<'s>(set: &HashSet<&'s str>) -> Vec<&'s str> {
    let mut v: Vec<&str> = set.iter().copied().collect();
    v.sort_unstable();
    v
}
