//! The model states file(s): `module` (model-dtype copies of the master weights at stages 1
//! and 2, placeholders at stage 3, buffers and frozen parameters), frozen parameter records,
//! `param_shapes` and the source's other entries, carried.

use super::super::{names, partition};
use super::archive::{int, s, size, At, Place};
use super::flats::Flat;
use super::job::Kind;
use super::Writer;
use crate::error::Result;
use crate::layout::DType;
use crate::torch::pickle::{extra_value, PyValue};
use std::collections::{HashMap, HashSet};

/// What each `module` entry is, by name.
struct Roles<'n> {
    /// Trainable parameters (held by the flat tensors).
    trainable: HashSet<&'n str>,
    /// Frozen parameters.
    frozen: HashSet<&'n str>,
    /// Tied name → the parameter it shares.
    shared: &'n HashMap<&'n str, &'n str>,
}

/// Where the model states files store output tensors, gathered over the files.
#[derive(Default)]
struct Kept {
    /// Per `module` entry stored whole (by target index): each file's storage of it.
    whole: HashMap<usize, Vec<At>>,
    /// Stage 3: per frozen parameter (by target index), each rank's chunk.
    frags: HashMap<usize, Vec<At>>,
    /// Second copies of a tensor: (copy's name, dtype, shape, the tensor's name, storage).
    copies: Vec<(String, DType, Vec<u64>, String, At)>,
}

impl Writer<'_> {
    /// The model states file(s): one at stages 1 and 2, one per rank at stage 3.
    pub(super) fn model_files(
        &mut self,
        dir: &std::path::Path,
        flats: &[Flat],
        module: &[usize],
        frozen: &[usize],
        shared: &HashMap<&str, &str>,
    ) -> Result<()> {
        let target = self.target;
        let stage3 = self.job.kind == Kind::Zero3;
        let files = if stage3 { self.m } else { 1 };
        let roles = Roles {
            trainable: flats
                .iter()
                .flat_map(|f| f.params.iter().map(|(n, _, _)| n.as_str()))
                .collect(),
            frozen: frozen.iter().map(|&i| target[i].name.as_str()).collect(),
            shared,
        };
        let mut kept = Kept::default();
        for r in 0..files {
            let path = if stage3 {
                dir.join(names::rank_model_states(r))
            } else {
                dir.join(names::model_states())
            };
            let file = self.archive(path);
            let module_dict = self.module_dict(file, module, &roles, &mut kept);
            let fragments = self.frozen_fragments(file, frozen, &mut kept);
            let top = self.model_states(module_dict, fragments, frozen, flats);
            self.values.push(top);
        }
        self.place_module(module, frozen, kept);
        Ok(())
    }

    /// `module` in file `file`: each entry a new storage (a placeholder for a parameter at
    /// stage 3), a tied name the value of the parameter it shares.
    fn module_dict(
        &mut self,
        file: usize,
        module: &[usize],
        roles: &Roles,
        kept: &mut Kept,
    ) -> PyValue {
        let target = self.target;
        let job = self.job;
        let stage3 = job.kind == Kind::Zero3;
        let mut module_dict = vec![];
        let mut stored: HashMap<&str, PyValue> = HashMap::new();
        for &i in module {
            let t = &target[i];
            let n = t.name.as_str();
            if let Some(of) = roles.shared.get(n) {
                if let Some(v) = stored.get(of) {
                    module_dict.push((s(n), v.clone()));
                    continue;
                }
            }
            let v = if stage3 && (roles.trainable.contains(n) || roles.frozen.contains(n)) {
                // partitioned: an empty placeholder of the parameter's dtype
                let dtype = if roles.trainable.contains(n) {
                    job.model_dtype
                } else {
                    t.dtype
                };
                self.tensor(file, dtype, vec![0]).0
            } else if roles.trainable.contains(n) {
                // stages 1 and 2: the model-dtype copy of the master weights
                let (v, at) = self.tensor(file, job.model_dtype, t.shape.clone());
                kept.copies.push((
                    format!("module:{n}"),
                    job.model_dtype,
                    t.shape.clone(),
                    n.to_string(),
                    at,
                ));
                v
            } else {
                let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                kept.whole.entry(i).or_default().push(at);
                v
            };
            stored.insert(n, v.clone());
            module_dict.push((s(n), v));
        }
        PyValue::OrderedDict(module_dict)
    }

    /// `frozen_param_fragments` in file `file`: stage 2 keeps a second whole copy of each
    /// frozen parameter, stage 3 this rank's chunk; `None` at stage 1.
    fn frozen_fragments(&mut self, file: usize, frozen: &[usize], kept: &mut Kept) -> PyValue {
        let target = self.target;
        match self.job.kind {
            Kind::Zero12(2) => PyValue::Dict(
                frozen
                    .iter()
                    .map(|&i| {
                        let t = &target[i];
                        let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                        kept.copies.push((
                            format!("frozen_param_fragments:{}", t.name),
                            t.dtype,
                            t.shape.clone(),
                            t.name.clone(),
                            at,
                        ));
                        (s(&t.name), v)
                    })
                    .collect(),
            ),
            Kind::Zero3 => PyValue::Dict(
                frozen
                    .iter()
                    .map(|&i| {
                        let t = &target[i];
                        let (_, c) = self.frozen_chunk(&t.shape);
                        let (v, at) = self.tensor(file, t.dtype, vec![c]);
                        kept.frags.entry(i).or_default().push(at);
                        (s(&t.name), v)
                    })
                    .collect(),
            ),
            _ => PyValue::None,
        }
    }

    /// A frozen parameter of `shape` at stage 3: its element count and each rank's chunk.
    fn frozen_chunk(&self, shape: &[u64]) -> (u64, u64) {
        let n: u64 = shape.iter().product();
        (n, partition::chunk(n, self.m))
    }

    /// A model states file's top-level dict: `module` (`module_dict`), the source's entries
    /// in their order with those that depend on the degree recomputed, and what the engine
    /// always saves where the source lacked it.
    fn model_states(
        &self,
        module_dict: PyValue,
        fragments: PyValue,
        frozen: &[usize],
        flats: &[Flat],
    ) -> PyValue {
        let target = self.target;
        let frozen_shapes = if self.job.stage() >= 2 {
            PyValue::Dict(
                frozen
                    .iter()
                    .map(|&i| (s(&target[i].name), size(&target[i].shape)))
                    .collect(),
            )
        } else {
            PyValue::None
        };
        // per flat tensor: a group at stages 1 and 2, a sub-group at 3
        let param_shapes = PyValue::List(
            flats
                .iter()
                .map(|f| {
                    PyValue::OrderedDict(
                        f.params.iter().map(|(n, sh, _)| (s(n), size(sh))).collect(),
                    )
                })
                .collect(),
        );
        let mut top = vec![(s("module"), module_dict)];
        let mut placed = HashSet::new();
        let mut put = |top: &mut Vec<(PyValue, PyValue)>, k: &str, v: PyValue| {
            if placed.insert(k.to_string()) {
                top.push((s(k), v));
            }
        };
        for e in &self.job.entries {
            match e.name.as_str() {
                "buffer_names" => {
                    put(&mut top, "buffer_names", extra_value(e));
                    put(&mut top, "optimizer", PyValue::None);
                }
                "param_shapes" => put(&mut top, "param_shapes", param_shapes.clone()),
                "frozen_param_shapes" => {
                    put(&mut top, "frozen_param_shapes", frozen_shapes.clone())
                }
                "shared_params" => {
                    put(&mut top, "shared_params", extra_value(e));
                    put(&mut top, "frozen_param_fragments", fragments.clone());
                }
                "dp_world_size" => put(&mut top, "dp_world_size", int(self.m)),
                "ds_config" => put(&mut top, "ds_config", self.config()),
                "frozen_param_fragments" | "optimizer" | "module" => {}
                n => put(&mut top, n, extra_value(e)),
            }
        }
        // what the engine always saves, where the source lacked it
        put(&mut top, "buffer_names", PyValue::List(vec![]));
        put(&mut top, "optimizer", PyValue::None);
        put(&mut top, "param_shapes", param_shapes);
        put(&mut top, "frozen_param_shapes", frozen_shapes);
        put(&mut top, "shared_params", PyValue::Dict(vec![]));
        put(&mut top, "frozen_param_fragments", fragments);
        put(&mut top, "dp_world_size", int(self.m));
        PyValue::Dict(top)
    }

    /// The output tensors the model states files hold: `module` entries stored whole (in
    /// `module`'s order), frozen parameters chunked at stage 3, then the second copies.
    fn place_module(&mut self, module: &[usize], frozen: &[usize], mut kept: Kept) {
        let target = self.target;
        for &i in module {
            if let Some(ats) = kept.whole.remove(&i) {
                let t = &target[i];
                self.place(t.name.clone(), t.dtype, t.shape.clone(), Place::Whole(ats));
            }
        }
        for &i in frozen {
            if let Some(ats) = kept.frags.remove(&i) {
                let t = &target[i];
                let (n, c) = self.frozen_chunk(&t.shape);
                let spans = partition::chunk_spans(n, c, self.m, 0);
                self.place(
                    t.name.clone(),
                    t.dtype,
                    t.shape.clone(),
                    Place::Flat(spans, ats),
                );
            }
        }
        for (name, dtype, shape, of, at) in kept.copies {
            self.copies.push((name.clone(), of));
            self.place(name, dtype, shape, Place::Whole(vec![at]));
        }
    }
}
