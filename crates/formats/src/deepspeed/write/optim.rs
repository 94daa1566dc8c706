//! The M optim files: each rank's fp32 master partitions, the wrapped optimizer's state and
//! parameter groups over the flat tensors, and the ZeRO wrapper's records (loss scaler,
//! paddings, partition counts, `param_slice_mappings`).

use super::super::names;
use super::super::partition::FlatGroup;
use super::super::records::{FRAGMENT_ADDRESS, ZERO_STAGE_ENUM};
use super::archive::{int, s, At, Place};
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

/// One state key of a flat tensor: its name, how it is kept, and the target tensor of the
/// group's first parameter for it.
type StateKey = (String, StateKind, usize);

/// A flat tensor's optimizer state: the keys of its first parameter, which all must share,
/// and that parameter's non-tensor entries.
struct FlatState {
    keys: Vec<StateKey>,
    values: Vec<(String, PyValue)>,
}

/// Where the optim files store each flat tensor's data: per flat tensor, each rank's storage
/// of its fp32 partition, and of each state key.
struct Stored {
    fp32: Vec<Vec<At>>,
    state: Vec<Vec<Vec<At>>>,
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
        let flat_states = flats
            .iter()
            .map(|f| self.flat_state(f, state))
            .collect::<Result<Vec<_>>>()?;
        let mut stored = Stored {
            fp32: vec![vec![]; flats.len()],
            state: flat_states
                .iter()
                .map(|fs| vec![vec![]; fs.keys.len()])
                .collect(),
        };
        let bf16_files = self.job.model_dtype == DType::BF16;
        for r in 0..self.m {
            let file = self.archive(dir.join(names::optim_states(r, bf16_files)));
            let st = self.wrapped_state(file, flats, &flat_states, &mut stored);
            let base = PyValue::Dict(vec![
                (s("state"), st),
                (s("param_groups"), self.param_groups(flats)),
            ]);
            // the fp32 master weights
            let mut masters = vec![];
            for (fi, f) in flats.iter().enumerate() {
                let len = match (&f.layout, self.job.kind) {
                    (Some(l), Kind::Zero12(_)) => f.len - l.rank_padding(r),
                    _ => f.len,
                };
                let (v, at) = self.tensor(file, DType::F32, vec![len]);
                stored.fp32[fi].push(at);
                masters.push(v);
            }
            let osd = self.wrapper(r, flats, base, PyValue::List(masters));
            let top = PyValue::Dict(vec![
                (s("optimizer_state_dict"), osd),
                (s("ds_config"), self.config()),
                (s("ds_version"), self.job.ds_version.clone()),
            ]);
            self.values.push(top);
        }
        self.place_flats(flats, &flat_states, state, &stored);
        Ok(())
    }

    /// Flat tensor `f`'s state: the keys of its first parameter (none for a group without
    /// trainable parameters), every parameter's checked to be the same and of its shape.
    fn flat_state(&self, f: &Flat, state: &HashMap<String, ParamState>) -> Result<FlatState> {
        let target = self.target;
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
        Ok(FlatState {
            keys,
            values: first.values,
        })
    }

    /// The wrapped optimizer's `state` over the flat tensors in optim file `file`: each
    /// state tensor a new storage (noted in `stored`), then the non-tensor entries.
    fn wrapped_state(
        &mut self,
        file: usize,
        flats: &[Flat],
        flat_states: &[FlatState],
        stored: &mut Stored,
    ) -> PyValue {
        let mut st = vec![];
        for (fi, f) in flats.iter().enumerate() {
            let mut entries = vec![];
            for (ki, (k, kind, _)) in flat_states[fi].keys.iter().enumerate() {
                let (v, at) = match kind {
                    StateKind::Scalar(d) => self.tensor(file, *d, vec![]),
                    StateKind::Flat(d) => self.tensor(file, *d, vec![f.len]),
                };
                stored.state[fi][ki].push(at);
                entries.push((s(k), v));
            }
            for (k, v) in &flat_states[fi].values {
                entries.push((s(k), v.clone()));
            }
            st.push((int(fi as u64), PyValue::Dict(entries)));
        }
        PyValue::Dict(st)
    }

    /// The wrapped optimizer's `param_groups`: each group's hyperparameters, and its flat
    /// tensors as `params`.
    pub(super) fn param_groups(&self, flats: &[Flat]) -> PyValue {
        let groups = (0..self.job.groups.len())
            .map(|g| {
                let mut d: Vec<(PyValue, PyValue)> = self.job.hyper[g]
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
        PyValue::List(groups)
    }

    /// The ZeRO wrapper's `optimizer_state_dict` of rank `r`, holding the wrapped
    /// optimizer's state dict `base` and the fp32 partitions `masters`.
    pub(super) fn wrapper(
        &self,
        r: u64,
        flats: &[Flat],
        base: PyValue,
        masters: PyValue,
    ) -> PyValue {
        let job = self.job;
        match job.kind {
            Kind::Zero3 => {
                let mut d = vec![(s("zero_stage"), zero_stage(3))];
                d.extend(self.loss_scaling());
                d.extend([
                    (s("partition_count"), int(self.m)),
                    (s("optimizer_state_dict"), base),
                    (s("fp32_flat_groups"), masters),
                ]);
                PyValue::Dict(d)
            }
            Kind::Zero12(stage) => {
                let layouts: Vec<&FlatGroup> =
                    flats.iter().filter_map(|f| f.layout.as_ref()).collect();
                let mut d = self.loss_scaling();
                d.extend(self.partitions(base, masters));
                d.extend([
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
                ]);
                d.extend(self.slices(r, flats));
                PyValue::Dict(d)
            }
            Kind::Bf16 => {
                // the padding of every group sits at the last rank's end
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
                let mut d = self.partitions(base, masters);
                d.push((s("group_paddings"), PyValue::List(pads)));
                d.extend(self.slices(r, flats));
                PyValue::Dict(d)
            }
        }
    }

    /// The loss scaling entries of the stage 1/2 and 3 wrappers.
    fn loss_scaling(&self) -> Vec<(PyValue, PyValue)> {
        let job = self.job;
        vec![
            (s("loss_scaler"), job.loss_scaler()),
            (
                s("dynamic_loss_scale"),
                job.scalar("dynamic_loss_scale", PyValue::Bool(false)),
            ),
            (s("overflow"), job.scalar("overflow", PyValue::Bool(false))),
        ]
    }

    /// The stage 1/2 and bf16 wrappers' `clip_grad`, the wrapped optimizer's state dict
    /// `base` and the fp32 partitions `masters`.
    fn partitions(&self, base: PyValue, masters: PyValue) -> Vec<(PyValue, PyValue)> {
        vec![
            (
                s("clip_grad"),
                self.job.scalar("clip_grad", PyValue::Float(1.0)),
            ),
            (s("base_optimizer_state"), base),
            (s("single_partition_of_fp32_groups"), masters),
        ]
    }

    /// The stage 1/2 and bf16 wrappers' `partition_count`, `ds_version` and rank `r`'s
    /// `param_slice_mappings`.
    fn slices(&self, r: u64, flats: &[Flat]) -> Vec<(PyValue, PyValue)> {
        vec![
            (
                s("partition_count"),
                PyValue::List(vec![int(self.m); self.job.groups.len()]),
            ),
            (s("ds_version"), self.job.ds_version.clone()),
            (s("param_slice_mappings"), slice_mappings(flats, r)),
        ]
    }

    /// The output tensors the optim files hold: each parameter's fp32 master weights and
    /// optimizer state over the ranks' flat tensors (a scalar's, the group's first
    /// parameter's, in every rank's file).
    fn place_flats(
        &mut self,
        flats: &[Flat],
        flat_states: &[FlatState],
        state: &HashMap<String, ParamState>,
        stored: &Stored,
    ) {
        let target = self.target;
        for (fi, f) in flats.iter().enumerate() {
            for (name, shape, spans) in &f.params {
                let place = Place::Flat(spans.clone(), stored.fp32[fi].clone());
                self.place(name.clone(), DType::F32, shape.clone(), place);
            }
            for (ki, (k, kind, first)) in flat_states[fi].keys.iter().enumerate() {
                let ats = &stored.state[fi][ki];
                match kind {
                    StateKind::Scalar(d) => {
                        // the group's first parameter's value stands for the flat tensor
                        let name = target[*first].name.clone();
                        self.place(name, *d, vec![], Place::Whole(ats.clone()));
                    }
                    StateKind::Flat(d) => {
                        for (name, shape, spans) in &f.params {
                            let ps = &state[name];
                            let i = ps
                                .tensors
                                .iter()
                                .find(|(key, _)| key == k)
                                .map(|(_, i)| *i)
                                .expect("keys checked equal");
                            let place = Place::Flat(spans.clone(), ats.clone());
                            self.place(target[i].name.clone(), *d, shape.clone(), place);
                        }
                    }
                }
            }
        }
    }
}

/// `ZeroStageEnum(stage)`.
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
fn slice_mappings(flats: &[Flat], r: u64) -> PyValue {
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

/// The names of `set`, sorted (for messages).
fn sorted<'s>(set: &HashSet<&'s str>) -> Vec<&'s str> {
    let mut v: Vec<&str> = set.iter().copied().collect();
    v.sort_unstable();
    v
}
