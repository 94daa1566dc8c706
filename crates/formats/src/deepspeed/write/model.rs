//! The model states file(s): `module` (model-dtype copies of the master weights at stages 1
//! and 2, placeholders at stage 3, buffers and frozen parameters), frozen parameter records,
//! `param_shapes` and the source's other entries, carried.

use super::super::{names, partition};
use super::archive::{int, s, size, At, Out, Place};
use super::flats::Flat;
use super::job::Kind;
use super::Writer;
use crate::error::Result;
use crate::layout::DType;
use crate::torch::pickle::{extra_value, PyValue};
use std::collections::{HashMap, HashSet};

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
        let job = self.job;
        let target = self.target;
        let stage3 = job.kind == Kind::Zero3;
        let files = if stage3 { self.m } else { 1 };
        let frozen_names: HashSet<&str> = frozen.iter().map(|&i| target[i].name.as_str()).collect();
        let trainable: HashSet<&str> = flats
            .iter()
            .flat_map(|f| f.params.iter().map(|(n, _, _)| n.as_str()))
            .collect();
        let mut whole: HashMap<usize, Vec<At>> = HashMap::new();
        let mut copies: Vec<(String, DType, Vec<u64>, String, At)> = vec![];
        let mut frags: HashMap<usize, Vec<At>> = HashMap::new();
        for r in 0..files {
            let path = if stage3 {
                dir.join(names::rank_model_states(r))
            } else {
                dir.join(names::model_states())
            };
            let file = self.archive(path);
            let mut module_dict = vec![];
            let mut stored: HashMap<&str, PyValue> = HashMap::new();
            for &i in module {
                let t = &target[i];
                let n = t.name.as_str();
                if let Some(of) = shared.get(n) {
                    if let Some(v) = stored.get(of) {
                        module_dict.push((s(n), v.clone()));
                        continue;
                    }
                }
                let v = if stage3 && (trainable.contains(n) || frozen_names.contains(n)) {
                    // partitioned: an empty placeholder of the parameter's dtype
                    let dtype = if trainable.contains(n) {
                        job.model_dtype
                    } else {
                        t.dtype
                    };
                    self.tensor(file, dtype, vec![0]).0
                } else if trainable.contains(n) {
                    // stages 1 and 2: the model-dtype copy of the master weights
                    let (v, at) = self.tensor(file, job.model_dtype, t.shape.clone());
                    copies.push((
                        format!("module:{n}"),
                        job.model_dtype,
                        t.shape.clone(),
                        n.to_string(),
                        at,
                    ));
                    v
                } else {
                    let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                    whole.entry(i).or_default().push(at);
                    v
                };
                stored.insert(n, v.clone());
                module_dict.push((s(n), v));
            }
            // frozen parameters: stage 2 keeps a second whole copy, stage 3 this rank's chunk
            let fragments = match job.kind {
                Kind::Zero12(2) => PyValue::Dict(
                    frozen
                        .iter()
                        .map(|&i| {
                            let t = &target[i];
                            let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                            copies.push((
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
                            let n: u64 = t.shape.iter().product();
                            let c = partition::chunk(n, self.m);
                            let (v, at) = self.tensor(file, t.dtype, vec![c]);
                            frags.entry(i).or_default().push(at);
                            (s(&t.name), v)
                        })
                        .collect(),
                ),
                _ => PyValue::None,
            };
            let frozen_shapes = if job.stage() >= 2 {
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
            let mut top = vec![(s("module"), PyValue::OrderedDict(module_dict))];
            let mut placed = HashSet::new();
            let mut put = |top: &mut Vec<(PyValue, PyValue)>, k: &str, v: PyValue| {
                if placed.insert(k.to_string()) {
                    top.push((s(k), v));
                }
            };
            for e in &job.entries {
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
            self.values.push(PyValue::Dict(top));
        }
        for &i in module {
            if let Some(ats) = whole.remove(&i) {
                let t = &target[i];
                self.outs.push(Out {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    place: Place::Whole(ats),
                });
            }
        }
        for &i in frozen {
            if let Some(ats) = frags.remove(&i) {
                let t = &target[i];
                let n: u64 = t.shape.iter().product();
                let spans = partition::chunk_spans(n, partition::chunk(n, self.m), self.m, 0);
                self.outs.push(Out {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    place: Place::Flat(spans, ats),
                });
            }
        }
        for (name, dtype, shape, of, at) in copies {
            self.copies.push((name.clone(), of));
            self.outs.push(Out {
                name,
                dtype,
                shape,
                place: Place::Whole(vec![at]),
            });
        }
        Ok(())
    }
}
