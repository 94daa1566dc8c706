//! The files of a universal checkpoint that replace the optim files: per trainable
//! parameter a folder `zero/<param>/` holding its fp32 master weights and each optimizer
//! state key whole (`{cat_dim: 0, param: tensor}`, the step a bare value), per other `module`
//! entry at stages 1 and 2 its values as fp32 (`{param: tensor}`, as `ds_to_universal` adds
//! them), and `zero/optimizer_state.pt`, the ZeRO wrapper's state without its partitions.

use super::archive::{int, s, Place};
use super::flats::Flat;
use super::job::Kind;
use super::optim::ParamState;
use super::{needs, Writer};
use crate::error::{Error, Result};
use crate::layout::DType;
use crate::torch::pickle::PyValue;
use crate::torch::short;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The Adam moments DeepSpeed's universal loader reads for every trainable parameter.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// `name` as a folder under `zero/`: one plain path component.
fn folder(name: &str) -> Result<&str> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !name.contains(':');
    if plain {
        Ok(name)
    } else {
        Err(needs(format!(
            "names a folder per parameter under zero/; `{}` is not a plain folder name",
            short(name)
        )))
    }
}

/// `{cat_dim: 0, param: tensor}`, as `ds_to_universal` saves a merged tensor.
fn cat_dim_dict(tensor: PyValue) -> PyValue {
    PyValue::Dict(vec![(s("cat_dim"), int(0)), (s("param"), tensor)])
}

impl Writer<'_> {
    /// The `zero/` folder: every trainable parameter's files, the other `module` entries'
    /// fp32 copies (stages 1 and 2), and `optimizer_state.pt`.
    pub(super) fn universal_files(
        &mut self,
        dir: &Path,
        flats: &[Flat],
        state: &HashMap<String, ParamState>,
        module: &[usize],
    ) -> Result<()> {
        let target = self.target;
        let zero = dir.join("zero");
        let mut trainable: HashSet<&str> = HashSet::new();
        // per flat tensor, its first parameter's step (stage 3's optimizer_state.pt keeps it)
        let mut steps: HashMap<String, (Option<usize>, Option<PyValue>)> = HashMap::new();
        for (name, shape) in self.job.groups.iter().flatten() {
            trainable.insert(name.as_str());
            let pdir = zero.join(folder(name)?);
            let ps = state.get(name).cloned().unwrap_or_default();
            for key in MOMENTS {
                if !ps.tensors.iter().any(|(k, _)| k == key) {
                    return Err(needs(format!(
                        "(universal) needs the Adam moments exp_avg and exp_avg_sq of every \
                         trainable parameter, which DeepSpeed's universal loader reads; `{}` \
                         has no `{key}` in the source",
                        short(name)
                    )));
                }
            }
            // the fp32 master weights
            let file = self.archive(pdir.join("fp32.pt"));
            let (v, at) = self.tensor(file, DType::F32, shape.clone());
            self.values.push(cat_dim_dict(v));
            self.place(
                name.clone(),
                DType::F32,
                shape.clone(),
                Place::Whole(vec![at]),
            );
            // each optimizer state key
            let mut step = (None, None);
            for (k, i) in &ps.tensors {
                let t = &target[*i];
                let file = self.archive(pdir.join(format!("{}.pt", folder(k)?)));
                if k == "step" || t.shape.is_empty() {
                    let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                    self.values.push(v);
                    self.place(
                        t.name.clone(),
                        t.dtype,
                        t.shape.clone(),
                        Place::Whole(vec![at]),
                    );
                    if k == "step" {
                        step.0 = Some(*i);
                    }
                } else {
                    if &t.shape != shape {
                        return Err(Error::layout(
                            &t.name,
                            format!("has shape {:?}; its parameter's is {shape:?}", t.shape),
                        ));
                    }
                    let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                    self.values.push(cat_dim_dict(v));
                    self.place(
                        t.name.clone(),
                        t.dtype,
                        t.shape.clone(),
                        Place::Whole(vec![at]),
                    );
                }
            }
            for (k, v) in &ps.values {
                if ps.tensors.iter().any(|(tk, _)| tk == k) {
                    continue;
                }
                self.archive(pdir.join(format!("{}.pt", folder(k)?)));
                self.values.push(v.clone());
                if k == "step" {
                    step.1 = Some(v.clone());
                }
            }
            steps.insert(name.clone(), step);
        }
        if self.job.kind != Kind::Zero3 {
            // ds_to_universal gives every other `module` entry an fp32 copy
            let mut done: HashSet<&str> = HashSet::new();
            for &i in module {
                let t = &target[i];
                let n = t.name.as_str();
                if trainable.contains(n) || !done.insert(n) {
                    continue;
                }
                let file = self.archive(zero.join(folder(n)?).join("fp32.pt"));
                let (v, at) = self.tensor(file, DType::F32, t.shape.clone());
                self.values.push(PyValue::Dict(vec![(s("param"), v)]));
                let copy = format!("universal-fp32:{n}");
                self.copies.push((copy.clone(), n.to_string()));
                self.place(copy, DType::F32, t.shape.clone(), Place::Whole(vec![at]));
            }
        }
        self.optimizer_state_file(&zero, flats, &steps);
        Ok(())
    }

    /// `zero/optimizer_state.pt`: the ZeRO wrapper's rank-0 state without what is per rank
    /// (partitions, their state, `param_slice_mappings`), and `param_groups`; at stage 3 also
    /// `optimizer_state_dict` with each flat tensor's step, which DeepSpeed's stage 3 loader
    /// reads.
    fn optimizer_state_file(
        &mut self,
        zero: &Path,
        flats: &[Flat],
        steps: &HashMap<String, (Option<usize>, Option<PyValue>)>,
    ) {
        let target = self.target;
        let file = self.archive(zero.join("optimizer_state.pt"));
        let groups = self.param_groups(flats);
        let wrapper = self.wrapper(0, flats, PyValue::None, PyValue::None);
        let entries = match wrapper {
            PyValue::Dict(entries) => entries,
            _ => vec![],
        };
        let mut top = vec![];
        for (k, v) in entries {
            let PyValue::Str(name) = &k else { continue };
            match name.as_str() {
                "base_optimizer_state"
                | "single_partition_of_fp32_groups"
                | "param_slice_mappings"
                | "fp32_flat_groups" => {}
                "optimizer_state_dict" => {
                    let mut st = vec![];
                    for (fi, f) in flats.iter().enumerate() {
                        let Some((first, _, _)) = f.params.first() else {
                            continue;
                        };
                        let step = match steps.get(first) {
                            Some((Some(i), _)) => {
                                let t = &target[*i];
                                let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                                let copy = format!("universal-step:{fi}");
                                self.copies.push((copy.clone(), t.name.clone()));
                                self.place(copy, t.dtype, t.shape.clone(), Place::Whole(vec![at]));
                                v
                            }
                            Some((None, Some(v))) => v.clone(),
                            _ => continue,
                        };
                        st.push((int(fi as u64), PyValue::Dict(vec![(s("step"), step)])));
                    }
                    let osd = PyValue::Dict(vec![
                        (s("state"), PyValue::Dict(st)),
                        (s("param_groups"), groups.clone()),
                    ]);
                    top.push((k, osd));
                }
                _ => top.push((k, v)),
            }
        }
        top.push((s("param_groups"), groups));
        self.values.push(PyValue::Dict(top));
    }
}
