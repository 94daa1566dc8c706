//! Reading a ZeRO checkpoint: the tag folder's files → one [`Checkpoint`] whose tensors are
//! the model's parameters and buffers under their module names (as `zero_to_fp32` names them)
//! and the optimizer state as `optimizer.state.<name>.<key>`, each a layout over the rank
//! files — flat ranges of the fp32 partitions expressed as boxes of the parameter
//! (`flat_range_boxes`), so the planner and executor need nothing DeepSpeed-specific.
//!
//! - Parameters: the fp32 master weights of the optim files by default ([`Weights::Master`]),
//!   or the model-dtype weights of the model states' `module` ([`Weights::Model`], stages 1
//!   and 2; stage 3 keeps none). Frozen parameters come from `module` (stages 1 and 2) or from
//!   every rank's `frozen_param_fragments` (stage 3); buffers from `module`; a tied name
//!   (`shared_params`) has the layout of the parameter it shares.
//! - Optimizer state: each flat tensor's state (`exp_avg`, `exp_avg_sq`: one value per element
//!   of the partition; `step`: one per flat tensor, given to each of its parameters, every
//!   rank's copy a replica), and `optimizer.param_groups.<g>.<key>` (hyperparameters; `params`
//!   as the group's parameter names, as torch's `get_optimizer_state_dict` gives them).
//! - Non-tensor entries: every other key of the model states (engine counters, `ds_config`,
//!   `param_shapes`, client state) under its own name, and the ZeRO wrapper's scalars that do
//!   not depend on the degree as `optimizer_state_dict.<key>` (`loss_scaler` as its attribute
//!   dict, `zero_stage` as an int).
//!
//! Refused with one line naming the file: model-parallel or pipeline-parallel checkpoints,
//! missing or extra rank files, files that disagree on the degree or the stage, partitions too
//! short for the parameters they must hold, optimizer state of another length.

use super::names::{self, Kind};
use super::partition::{self, FlatGroup, Span};
use super::records::{numel, File, ModelStates, OptimStates, Optimizer, StateEntry};
use crate::checkpoint::OpenOptions;
use crate::error::{Error, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::torch::save::TensorItem;
use crate::torch::short;
use crate::{dcp, Checkpoint, Extra, Format, KeyPart, RecordCrc};
use reshard_core::model::Weights;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The tag folder of the checkpoint at `path`: `path` itself when it holds model states,
/// else the folder its `latest` file names.
pub fn tag_dir(path: &Path) -> Result<PathBuf> {
    let files = crate::file_names(path)?;
    if files.iter().any(|n| n.ends_with("model_states.pt")) {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    if !latest.is_file() {
        return Err(Error::format(
            path,
            "holds no DeepSpeed model states file and no `latest` file",
        ));
    }
    let tag = names::read_tag_file(&latest)?;
    let dir = path.join(&tag);
    if !dir.is_dir() {
        return Err(Error::format(
            &latest,
            format!(
                "names tag `{}`, but {} is not a directory",
                short(&tag),
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

/// The files of a tag folder, by rank.
struct Layout {
    /// Stage 3: one model states file per rank; else the one shared file.
    model: Vec<PathBuf>,
    /// One optim states file per rank (with the `bf16_` prefix of a bf16 engine, if the
    /// files carry it).
    optim: Vec<PathBuf>,
}

/// The ZeRO files of a tag folder, by kind and name.
type Found = Vec<(Kind, String)>;

/// Find the model states and optim files of the tag folder `dir`, and the name of one that
/// belongs to a model-parallel rank other than 0, if any.
fn list(dir: &Path) -> Result<(Found, Option<String>)> {
    let mut out = vec![];
    for name in crate::file_names(dir)? {
        match names::kind(&name) {
            Some(Kind::Unsupported(what)) => {
                return Err(Error::format(
                    dir.join(&name),
                    format!("is one of {what}, which reshard does not read"),
                ))
            }
            Some(k) => out.push((k, name)),
            None => {}
        }
    }
    let mp = out.iter().find_map(|(k, n)| match k {
        Kind::ModelStates { mp } | Kind::RankModelStates { mp, .. } | Kind::Optim { mp, .. }
            if *mp != 0 =>
        {
            Some(n.clone())
        }
        _ => None,
    });
    Ok((out, mp))
}

impl Layout {
    /// The files for a checkpoint of `dp` ranks at `stage3` or not, each checked present.
    fn of(dir: &Path, found: &[(Kind, String)], dp: u64, stage3: bool) -> Result<Layout> {
        let bf16s: HashSet<bool> = found
            .iter()
            .filter_map(|(k, _)| match k {
                Kind::Optim { bf16, .. } => Some(*bf16),
                _ => None,
            })
            .collect();
        if bf16s.len() > 1 {
            return Err(Error::format(
                dir,
                "holds optim files both with and without the bf16_ prefix",
            ));
        }
        let bf16 = bf16s.contains(&true);
        let names: HashSet<&str> = found.iter().map(|(_, n)| n.as_str()).collect();
        let need = |name: String| -> Result<PathBuf> {
            if names.contains(name.as_str()) {
                Ok(dir.join(name))
            } else {
                Err(Error::format(
                    dir.join(&name),
                    format!("is missing: the checkpoint was saved by {dp} data-parallel ranks"),
                ))
            }
        };
        let model = if stage3 {
            (0..dp)
                .map(|r| need(names::rank_model_states(r)))
                .collect::<Result<_>>()?
        } else {
            vec![need(names::model_states())?]
        };
        let optim: Vec<PathBuf> = (0..dp)
            .map(|r| {
                let name = names::optim_states(r, bf16);
                match need(name.clone()) {
                    Ok(p) => Ok(p),
                    Err(e) => {
                        // DeepSpeed's loader also takes the old `..._mp_rank_00optim_states.pt`
                        let old = name.replace("_optim_states.pt", "optim_states.pt");
                        if names.contains(old.as_str()) {
                            Ok(dir.join(old))
                        } else {
                            Err(e)
                        }
                    }
                }
            })
            .collect::<Result<_>>()?;
        // a rank file beyond the degree: another save's leftovers, or a wrong dp_world_size
        for (k, n) in found {
            let extra = match k {
                Kind::Optim { rank, .. } => *rank >= dp,
                Kind::RankModelStates { rank, .. } => *rank >= dp || !stage3,
                _ => false,
            };
            if extra {
                return Err(Error::format(
                    dir.join(n),
                    format!("is a rank file beyond the {dp} data-parallel ranks the model states record"),
                ));
            }
        }
        Ok(Layout { model, optim })
    }
}

/// Read the ZeRO checkpoint at `path` (a checkpoint folder with `latest`, or a tag folder).
pub fn read(path: &Path, opts: &OpenOptions) -> Result<Checkpoint> {
    let dir = tag_dir(path)?;
    let (found, mp) = list(&dir)?;
    if let Some(n) = mp {
        return Err(Error::format(
            dir.join(n),
            "belongs to model-parallel rank > 0: tensor- or pipeline-parallel DeepSpeed \
             checkpoints are not supported (only mp_rank_00)",
        ));
    }
    // The stage shows in the file names: stage 3 has a model states file per rank.
    let stage3 = found
        .iter()
        .any(|(k, _)| matches!(k, Kind::RankModelStates { .. }));
    let first = if stage3 {
        dir.join(names::rank_model_states(0))
    } else {
        dir.join(names::model_states())
    };
    if !first.is_file() {
        return Err(Error::format(
            &first,
            "is missing: a DeepSpeed tag folder holds the engine's model states file",
        ));
    }
    let model0 = File::open(&first)?;
    let states0 = ModelStates::decode(&model0)?;
    let dp = states0.dp_world_size;
    let no_optim = !found.iter().any(|(k, _)| matches!(k, Kind::Optim { .. }));
    if no_optim && model0.value.get("optimizer").is_some_and(|o| !o.is_none()) {
        return Err(model0.err(
            "was saved without ZeRO (stage 0): the model states file holds the whole state \
             dict; read it as a .pt file",
        ));
    }
    let layout = Layout::of(&dir, &found, dp, stage3)?;
    let mut files: Vec<PathBuf> = layout.model.clone();
    files.extend(layout.optim.iter().cloned());
    let n_model = layout.model.len();

    // Decode every file (in parallel: each is a pickle of a few KB, and maps its file).
    let model_rest = decode_all(&layout.model[1..], ModelStates::decode)?;
    let optims = decode_all(&layout.optim, OptimStates::decode)?;
    let mut models = vec![(model0, states0)];
    models.extend(model_rest);

    let round_robin = matches!(optims[0].1.optimizer, Optimizer::Zero12 { .. })
        && models[0]
            .1
            .others
            .iter()
            .find(|(k, _)| k == "ds_config")
            .and_then(|(_, c)| {
                c.get("zero_optimization")?
                    .get("round_robin_gradients")?
                    .as_bool()
            })
            == Some(true);
    let r = Reader {
        dir: &dir,
        models: &models,
        optims: &optims,
        n_model: n_model as u32,
        dp,
        weights: opts.weights.unwrap_or(Weights::Master),
        round_robin,
        tensors: vec![],
        index: HashMap::new(),
        extras: vec![],
        paths: BTreeMap::new(),
        checksums: vec![],
        records: HashSet::new(),
    };
    let (optimizer, r) = r.run(stage3)?;
    let producer = producer(&models[0].1, optimizer, dp);
    Ok(Checkpoint {
        format: Format::DEEPSPEED,
        path: path.to_path_buf(),
        files,
        // `latest`, when it named the tag folder read
        side_files: Some(path.join("latest"))
            .filter(|l| dir.as_path() != path && l.is_file())
            .into_iter()
            .collect(),
        ranks: dp as u32,
        tensors: r.tensors,
        metadata: BTreeMap::new(),
        extras: r.extras,
        paths: r.paths,
        producer: Some(producer),
        saved: None,
        tag: dir.file_name().and_then(|n| n.to_str()).map(str::to_string),
        companions: vec![],
        scratch: vec![],
        checksums: r.checksums,
        locator: None,
        storage: reshard_storage::local(),
    })
}

/// Open and decode each file of `paths` with `decode`, in parallel.
fn decode_all<T: Send>(
    paths: &[PathBuf],
    decode: fn(&File) -> Result<T>,
) -> Result<Vec<(File, T)>> {
    use rayon::prelude::*;
    paths
        .par_iter()
        .map(|p| {
            let f = File::open(p)?;
            let s = decode(&f)?;
            Ok((f, s))
        })
        .collect()
}

/// What wrote the checkpoint: DeepSpeed's version (from the model states `states`), the
/// stage, the optimizer and the degree.
fn producer(states: &ModelStates, optimizer: Optimizer, dp: u64) -> String {
    let ds_version = states
        .others
        .iter()
        .find(|(k, _)| k == "ds_version")
        .and_then(|(_, v)| v.as_str().map(short));
    format!(
        "DeepSpeed{} ZeRO stage {} ({}), {dp} data-parallel rank(s)",
        ds_version.map(|v| format!(" {v}")).unwrap_or_default(),
        optimizer.stage(),
        match optimizer {
            Optimizer::Zero12 { .. } => "DeepSpeedZeroOptimizer",
            Optimizer::Bf16 => "BF16_Optimizer",
            Optimizer::Zero3 => "DeepSpeedZeroOptimizer_Stage3",
        }
    )
}

/// The walk from decoded files to layouts.
struct Reader<'a> {
    dir: &'a Path,
    /// Model states files (one, or one per rank at stage 3), decoded.
    models: &'a [(File, ModelStates)],
    /// Optim files by rank, decoded.
    optims: &'a [(File, OptimStates)],
    /// Files before the optim files in the checkpoint's file list.
    n_model: u32,
    dp: u64,
    weights: Weights,
    /// `zero_optimization.round_robin_gradients` of a stage 1/2 `DeepSpeedZeroOptimizer`:
    /// groups are flattened in round-robin order.
    round_robin: bool,
    tensors: Vec<TensorLayout>,
    /// Tensor name → index in `tensors`.
    index: HashMap<String, usize>,
    extras: Vec<Extra>,
    paths: BTreeMap<String, Vec<KeyPart>>,
    checksums: Vec<RecordCrc>,
    /// (file, record offset) of the records whose CRC is listed.
    records: HashSet<(u32, u64)>,
}

/// A parameter's place among the flat tensors: which flat tensor, and the runs of its
/// elements over the ranks.
struct Placed {
    name: String,
    shape: Vec<u64>,
    flat: usize,
    spans: Vec<Span>,
}

/// What [`Reader::module_tensors`] looks names up in, from the model states files.
struct ModuleNames<'m> {
    /// Trainable parameters, placed.
    trainable: HashMap<&'m str, &'m Placed>,
    /// `frozen_param_shapes`.
    frozen: HashMap<&'m str, &'m Vec<u64>>,
    /// `shared_params`: tied name → the parameter it shares.
    shared: HashMap<&'m str, &'m str>,
    /// `module`'s tensors.
    module: HashMap<&'m str, &'m TensorItem>,
}

impl<'m> ModuleNames<'m> {
    /// The names of the model states files `models` (rank 0's first) and of `placed`.
    fn of(models: &'m [(File, ModelStates)], placed: &'m [Placed]) -> ModuleNames<'m> {
        let states = &models[0].1;
        ModuleNames {
            trainable: placed.iter().map(|p| (p.name.as_str(), p)).collect(),
            frozen: states
                .frozen_param_shapes
                .iter()
                .map(|(n, s)| (n.as_str(), s))
                .collect(),
            shared: states
                .shared_params
                .iter()
                .map(|(a, b)| (a.as_str(), b.as_str()))
                .collect(),
            module: states.module.iter().map(|(n, t)| (n.as_str(), t)).collect(),
        }
    }
}

/// Stage 3: each rank's frozen parameter chunks, by name.
type Fragments<'a> = Vec<HashMap<&'a str, &'a TensorItem>>;

/// The frozen parameter chunks of the model states files `models`, by rank.
fn fragments(models: &[(File, ModelStates)]) -> Fragments<'_> {
    models
        .iter()
        .map(|(_, s)| {
            s.frozen_fragments
                .iter()
                .map(|(k, t)| (k.as_str(), t))
                .collect()
        })
        .collect()
}

impl<'a> Reader<'a> {
    fn run(mut self, stage3: bool) -> Result<(Optimizer, Reader<'a>)> {
        let (opt0_file, opt0) = &self.optims[0];
        let optimizer = opt0.optimizer;
        if (optimizer == Optimizer::Zero3) != stage3 {
            return Err(opt0_file.err(format!(
                "is a ZeRO stage {} optim file, but the model states files are those of {}",
                optimizer.stage(),
                if stage3 { "stage 3" } else { "stages 1 and 2" }
            )));
        }
        for (f, o) in &self.optims[1..] {
            if o.optimizer != optimizer
                || o.flat.len() != opt0.flat.len()
                || o.group_flats != opt0.group_flats
            {
                return Err(f.err(format!(
                    "disagrees with {} on the optimizer, its parameter groups or flat tensors",
                    opt0_file.path.display()
                )));
            }
        }
        let states = &self.models[0].1;
        // param_shapes lists the parameters of each flat tensor: a parameter group at stages
        // 1 and 2, a sub-group at stage 3
        if states.param_shapes.len() != opt0.flat.len() {
            return Err(opt0_file.err(format!(
                "has {} flat fp32 tensors, the model states' param_shapes {} groups",
                opt0.flat.len(),
                states.param_shapes.len()
            )));
        }
        for (f, o) in self.optims.iter() {
            if o.partition_count.iter().any(|&c| c != self.dp) {
                return Err(f.err(format!(
                    "records partition_count {:?}, the model states dp_world_size {}",
                    o.partition_count, self.dp
                )));
            }
        }
        for (f, s) in &self.models[1..] {
            if s.param_shapes != states.param_shapes || s.dp_world_size != self.dp {
                return Err(f.err(format!(
                    "disagrees with {} on param_shapes or dp_world_size",
                    self.models[0].0.path.display()
                )));
            }
        }
        let placed = if stage3 {
            self.place_stage3()?
        } else {
            self.place_stage12()?
        };
        self.module_tensors(&placed, stage3)?;
        self.optimizer_state(&placed)?;
        self.extras()?;
        Ok((optimizer, self))
    }

    /// Stages 1 and 2: each group's parameters over the flat partitions.
    fn place_stage12(&self) -> Result<Vec<Placed>> {
        let (opt0_file, opt0) = &self.optims[0];
        let mut out = vec![];
        for (g, flats) in opt0.group_flats.iter().enumerate() {
            let [flat] = flats[..] else {
                return Err(opt0_file.err(format!(
                    "parameter group {g} holds {} flat tensors, not one",
                    flats.len()
                )));
            };
            let shapes = &self.models[0].1.param_shapes[flat];
            let numels: Vec<u64> = shapes.iter().map(|(_, s)| numel(s)).collect();
            let paddings = match &opt0.param_alignment_paddings {
                Some(p) => p.get(g).cloned().unwrap_or_default(),
                None => vec![0; numels.len()],
            };
            if paddings.len() != numels.len() {
                return Err(opt0_file.err(format!(
                    "param_alignment_paddings of group {g} has {} entries for {} parameters",
                    paddings.len(),
                    numels.len()
                )));
            }
            let group = FlatGroup {
                numels,
                paddings,
                dp: self.dp,
            };
            self.check_partitions(g, flat, &group, shapes.len())?;
            let all = group.all_spans();
            let order = if self.round_robin {
                partition::round_robin(shapes.len(), self.dp)
            } else {
                (0..shapes.len()).collect()
            };
            let recorded_spans = partition::recorded_slices(&group, &order);
            self.check_slice_mappings(g, shapes, &recorded_spans)?;
            for ((name, shape), spans) in shapes.iter().zip(all) {
                out.push(Placed {
                    name: name.clone(),
                    shape: shape.clone(),
                    flat,
                    spans,
                });
            }
        }
        Ok(out)
    }

    /// Stages 1 and 2: check that every rank's fp32 partition of parameter group `g` (flat
    /// tensor `flat`, laid out as `group`, of `n_params` parameters) holds the elements it
    /// owns, and records the padding its partitions give.
    fn check_partitions(
        &self,
        g: usize,
        flat: usize,
        group: &FlatGroup,
        n_params: usize,
    ) -> Result<()> {
        let size = group.partition_size();
        // every rank's partition must hold the elements it owns
        for (r, (f, o)) in self.optims.iter().enumerate() {
            let t = &o.flat[flat];
            let have = t.shape[0];
            let owned = group
                .padded_numel()
                .saturating_sub(r as u64 * size)
                .min(size);
            let expected_pad = group.rank_padding(r as u64);
            let recorded = o.group_paddings.get(g).copied();
            if have < owned || have > size {
                return Err(f.err(format!(
                    "the fp32 partition of parameter group {g} has {have} elements; \
                 the group's {} parameters need {owned} of a {size}-element partition \
                 at {} ranks",
                    n_params, self.dp
                )));
            }
            if o.optimizer != Optimizer::Bf16 && recorded != Some(expected_pad) {
                return Err(f.err(format!(
                    "records group padding {} for parameter group {g}, its partitions \
                 give {expected_pad}",
                    recorded.map_or("none".into(), |p| p.to_string())
                )));
            }
        }
        Ok(())
    }

    /// Stages 1 and 2: check that each rank's slice mappings of parameter group `g` (its
    /// parameters `shapes`) are its own (`recorded_spans`): a file of another rank (swapped,
    /// copied) has another rank's.
    fn check_slice_mappings(
        &self,
        g: usize,
        shapes: &[(String, Vec<u64>)],
        recorded_spans: &[Vec<Span>],
    ) -> Result<()> {
        for (r, (f, o)) in self.optims.iter().enumerate() {
            let Some(recorded) = o.slice_mappings.as_ref().and_then(|m| m.get(g)) else {
                continue;
            };

            // by name: DeepSpeed lists them in the group's own order, which is not the
            // flattening order under round_robin_gradients
            let mut expected: Vec<(&str, u64, u64)> = shapes
                .iter()
                .zip(recorded_spans)
                .filter_map(|((n, _), spans)| {
                    let s = spans.iter().find(|s| s.rank == r as u64)?;
                    Some((n.as_str(), s.end - s.start, s.at))
                })
                .collect();
            let mut got: Vec<(&str, u64, u64)> = recorded
                .iter()
                .map(|(n, numel, at)| (n.as_str(), *numel, *at))
                .collect();
            expected.sort_unstable();
            got.sort_unstable();
            let same = got == expected;
            if !same {
                return Err(f.err(format!(
                    "records the parameter slices of another rank than {r} for parameter \
                 group {g} (param_slice_mappings): a rank file swapped or copied?"
                )));
            }
        }
        Ok(())
    }

    /// Stage 3: each parameter chunked over the ranks, chunks in order through its
    /// sub-group's flat tensor (`param_shapes` lists each sub-group's parameters).
    fn place_stage3(&self) -> Result<Vec<Placed>> {
        let (opt0_file, opt0) = &self.optims[0];
        let mut out = vec![];
        for flats in &opt0.group_flats {
            for &flat in flats {
                let len = opt0.flat[flat].shape[0];
                let mut at = 0u64;
                for (name, shape) in &self.models[0].1.param_shapes[flat] {
                    let c = partition::chunk(numel(shape), self.dp);
                    if at.saturating_add(c) > len {
                        return Err(opt0_file.err(format!(
                            "parameter `{}` ({c} elements a rank) overruns fp32 flat tensor \
                             {flat} of {len} elements",
                            short(name)
                        )));
                    }
                    out.push(Placed {
                        name: name.clone(),
                        shape: shape.clone(),
                        flat,
                        spans: partition::chunk_spans(numel(shape), c, self.dp, at),
                    });
                    at += c;
                }
                if at != len {
                    return Err(opt0_file.err(format!(
                        "fp32 flat tensor {flat} holds {len} elements, its parameters' chunks {at}"
                    )));
                }
            }
        }
        for (f, o) in &self.optims[1..] {
            for (i, t) in o.flat.iter().enumerate() {
                if t.shape != opt0.flat[i].shape {
                    return Err(f.err(format!(
                        "fp32 flat tensor {i} has {:?} elements, rank 0's {:?}",
                        t.shape, opt0.flat[i].shape
                    )));
                }
            }
        }
        Ok(out)
    }

    /// Note the CRC of the record holding `t` in file `file`.
    fn crc(&mut self, file: u32, f: &File, t: &TensorItem, what: &str) {
        if self.records.insert((file, t.record.offset)) {
            if let Some(crc) = f.record_crc(t) {
                self.checksums.push(RecordCrc {
                    file,
                    offset: t.record.offset,
                    len: t.record.len,
                    crc,
                    what: format!(
                        "{what} (record {}/data/{})",
                        f.archive.prefix, t.storage_key
                    )
                    .into(),
                    shown: None,
                });
            }
        }
    }

    fn push(&mut self, t: TensorLayout, path: Option<Vec<KeyPart>>) -> Result<()> {
        if self.index.contains_key(&t.name) {
            return Err(Error::format(
                self.dir,
                format!("names tensor `{}` twice", short(&t.name)),
            ));
        }
        if let Some(p) = path {
            self.paths.insert(t.name.clone(), p);
        }
        self.index.insert(t.name.clone(), self.tensors.len());
        self.tensors.push(t);
        Ok(())
    }

    /// The layout of a flat-partitioned tensor `name` of `shape` whose runs `spans` lie in the
    /// tensors `at(rank)` (file index, file, tensor) of dtype `dtype`.
    fn flat_layout(
        &mut self,
        name: &str,
        shape: &[u64],
        dtype: DType,
        spans: &[Span],
        at: impl Fn(u64) -> (u32, &'a File, &'a TensorItem),
    ) -> Result<TensorLayout> {
        let elem = dtype.size() as u64;
        let mut pieces = vec![];
        for s in spans {
            let (file, f, t) = at(s.rank);
            if t.dtype != dtype {
                return Err(f.err(format!(
                    "`{}` is {} where {} was expected",
                    short(name),
                    t.dtype,
                    dtype
                )));
            }
            if s.at + (s.end - s.start) > t.shape[0] {
                return Err(f.err(format!(
                    "the partition holding `{}` has {} elements; its elements {}..{} need {}",
                    short(name),
                    t.shape[0],
                    s.start,
                    s.end,
                    s.at + (s.end - s.start)
                )));
            }
            self.crc(file, f, t, &format!("`{}`", short(name)));
            pieces.extend(partition::flat_pieces(
                shape,
                std::slice::from_ref(s),
                |_| (file, t.data_offset()),
                elem,
            ));
        }
        Ok(TensorLayout {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            pieces,
        })
    }

    /// A tensor stored whole in file `file` (a `module` entry).
    fn whole(&mut self, name: &str, file: u32, f: &File, t: &TensorItem) -> TensorLayout {
        self.crc(file, f, t, &format!("`{}`", short(name)));
        let strides = (!t.is_row_major()).then(|| t.strides.clone());
        TensorLayout::whole(
            name.to_string(),
            t.dtype,
            t.shape.clone(),
            file,
            t.data_offset(),
            strides,
        )
    }

    /// Parameters (fp32 master or model weights), frozen parameters, buffers and tied names,
    /// in the order of `module`.
    fn module_tensors(&mut self, placed: &[Placed], stage3: bool) -> Result<()> {
        let (f0, states) = &self.models[0];
        let names = ModuleNames::of(self.models, placed);
        let fragments = fragments(self.models);
        if stage3 && self.weights == Weights::Model {
            return Err(f0.err(
                "is a ZeRO stage 3 checkpoint, which keeps no model-dtype copy of its \
                 parameters (only placeholders): read its fp32 master weights",
            ));
        }
        let in_module: HashSet<&str> = states.module.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(b) = states
            .buffer_names
            .iter()
            .find(|b| !in_module.contains(b.as_str()))
        {
            return Err(f0.err(format!("buffer `{}` is not in `module`", short(b))));
        }
        // `module`'s entries, then the parameters it lacks (stage 3 may leave them out)
        let mut order: Vec<&str> = states.module.iter().map(|(n, _)| n.as_str()).collect();
        order.extend(
            placed
                .iter()
                .map(|p| p.name.as_str())
                .chain(names.frozen.keys().copied())
                .filter(|n| !in_module.contains(n)),
        );
        let mut aliases = vec![];
        for name in order {
            if names.shared.contains_key(name) && !names.trainable.contains_key(name) {
                aliases.push(name);
                continue;
            }
            let layout = if let Some(p) = names.trainable.get(name) {
                self.parameter(name, p, &names)?
            } else if let (true, Some(shape)) = (stage3, names.frozen.get(name)) {
                self.frozen_fragments(name, shape, &fragments)?
            } else {
                // buffers, frozen parameters (stages 1, 2) and other module entries: whole
                let t = names.module.get(name).ok_or_else(|| {
                    f0.err(format!(
                        "frozen parameter `{}` is not in `module`",
                        short(name)
                    ))
                })?;
                if let Some(s) = names.frozen.get(name) {
                    if &&t.shape != s {
                        return Err(f0.err(format!(
                            "`module.{}` has shape {:?}, frozen_param_shapes {:?}",
                            short(name),
                            t.shape,
                            s
                        )));
                    }
                }
                self.whole(name, 0, f0, t)
            };
            self.push(layout, None)?;
        }
        self.aliases(&aliases, &names.shared)
    }

    /// A trainable parameter: its fp32 master weights over the optim files' flat tensors, or
    /// its model-dtype weights in `module`.
    fn parameter(&mut self, name: &str, p: &Placed, names: &ModuleNames) -> Result<TensorLayout> {
        match self.weights {
            Weights::Master => {
                let flat = p.flat;
                let optims = self.optims;
                let n_model = self.n_model;
                self.flat_layout(name, &p.shape, DType::F32, &p.spans, |r| {
                    let (f, o) = &optims[r as usize];
                    (n_model + r as u32, f, &o.flat[flat])
                })
            }
            Weights::Model => {
                let f0 = &self.models[0].0;
                let t = names.module.get(name).ok_or_else(|| {
                    f0.err(format!("parameter `{}` is not in `module`", short(name)))
                })?;
                if t.shape != p.shape {
                    return Err(f0.err(format!(
                        "`module.{}` has shape {:?}, param_shapes {:?}",
                        short(name),
                        t.shape,
                        p.shape
                    )));
                }
                Ok(self.whole(name, 0, f0, t))
            }
        }
    }

    /// A frozen parameter of `shape` at stage 3: chunked over the ranks like a trainable
    /// one, each rank's chunk in its model states file's `frozen_param_fragments`.
    fn frozen_fragments(
        &mut self,
        name: &str,
        shape: &[u64],
        fragments: &Fragments<'a>,
    ) -> Result<TensorLayout> {
        let models = self.models;
        let n = numel(shape);
        let c = partition::chunk(n, self.dp);
        let mut frags = vec![];
        for (r, (f, _)) in models.iter().enumerate() {
            let t = fragments[r].get(name).copied().ok_or_else(|| {
                f.err(format!(
                    "frozen parameter `{}` has no frozen_param_fragments entry",
                    short(name)
                ))
            })?;
            if t.shape.len() != 1 || !t.is_row_major() {
                return Err(f.err(format!(
                    "frozen_param_fragments.{} is not flat",
                    short(name)
                )));
            }
            frags.push((r as u32, f, t));
        }
        let dtype = frags[0].2.dtype;
        let spans = partition::chunk_spans(n, c, self.dp, 0);
        self.flat_layout(name, shape, dtype, &spans, |r| frags[r as usize])
    }

    /// Each tied name (`shared_params`) with the layout of the parameter it shares.
    fn aliases(&mut self, aliases: &[&str], shared: &HashMap<&str, &str>) -> Result<()> {
        let f0 = &self.models[0].0;
        for &alias in aliases {
            let source = shared[alias];
            let Some(&i) = self.index.get(source) else {
                return Err(f0.err(format!(
                    "shared parameter `{}` names `{}`, which is not a parameter",
                    short(alias),
                    short(source)
                )));
            };
            let mut t = self.tensors[i].clone();
            t.name = alias.to_string();
            self.push(t, None)?;
        }
        Ok(())
    }

    /// `optimizer.state.<name>.<key>` for every trainable parameter, and the param groups.
    fn optimizer_state(&mut self, placed: &[Placed]) -> Result<()> {
        let opt0 = &self.optims[0].1;
        for p in placed {
            for (key, entry) in &opt0.state[p.flat] {
                let name = format!("optimizer.state.{}.{key}", p.name);
                let path = vec![
                    KeyPart::Key("optimizer".into()),
                    KeyPart::Key("state".into()),
                    KeyPart::Key(p.name.clone()),
                    KeyPart::Key(key.clone()),
                ];
                match entry {
                    StateEntry::Tensor(t) if t.shape.is_empty() => {
                        let layout = self.scalar_state(&name, p.flat, key, t.dtype)?;
                        self.push(layout, Some(path))?;
                    }
                    StateEntry::Tensor(t) => {
                        let layout = self.flat_state(&name, p, key, t)?;
                        self.push(layout, Some(path))?;
                    }
                    StateEntry::Value(v) => {
                        self.paths.insert(name.clone(), path);
                        self.extras.push(extra(name, v.clone()));
                    }
                }
            }
        }
        self.param_groups();
        Ok(())
    }

    /// A state entry kept once per flat tensor (`step`), of `dtype`: every rank's copy a
    /// replica, stood for by `name`.
    fn scalar_state(
        &mut self,
        name: &str,
        flat: usize,
        key: &str,
        dtype: DType,
    ) -> Result<TensorLayout> {
        let optims = self.optims;
        let mut pieces = vec![];
        for (r, (f, o)) in optims.iter().enumerate() {
            let t = state_tensor(f, o, flat, key)?;
            if !t.shape.is_empty() || t.dtype != dtype {
                return Err(f.err(format!(
                    "optimizer state `{}` of flat tensor {} is not a {} scalar \
                     as on rank 0",
                    short(key),
                    flat,
                    dtype
                )));
            }
            let file = self.n_model + r as u32;
            self.crc(file, f, t, &format!("`{}`", short(name)));
            pieces.push(Piece {
                rank: r as u32,
                region: Region::full(&[]),
                loc: Loc {
                    file,
                    offset: t.data_offset(),
                    strides: None,
                    pending: None,
                },
            });
        }
        Ok(TensorLayout {
            name: name.to_string(),
            dtype,
            shape: vec![],
            pieces,
        })
    }

    /// A state entry with one value per element of the partition (`exp_avg`; with or without
    /// its tail padding: a flat tensor at least as long as the fp32 partition), rank 0's `t`,
    /// laid out over parameter `p` as its master weights are.
    fn flat_state(
        &mut self,
        name: &str,
        p: &Placed,
        key: &str,
        t: &TensorItem,
    ) -> Result<TensorLayout> {
        let optims = self.optims;
        let n_model = self.n_model;
        if t.shape.len() != 1 {
            return Err(optims[0].0.err(format!(
                "optimizer state `{}` of flat tensor {} has shape {:?}, not one \
                 value per element",
                short(key),
                p.flat,
                t.shape
            )));
        }
        let flat = p.flat;
        let mut states = vec![];
        for (r, (f, o)) in optims.iter().enumerate() {
            let t = state_tensor(f, o, flat, key)?;
            if t.shape.len() != 1 || !t.is_row_major() {
                return Err(f.err(format!(
                    "optimizer state `{}` of flat tensor {flat} is not flat",
                    short(key)
                )));
            }
            states.push((n_model + r as u32, f, t));
        }
        self.flat_layout(name, &p.shape, t.dtype, &p.spans, |r| states[r as usize])
    }

    /// `optimizer.param_groups.<g>.<key>`: each group's hyperparameters, and its parameter
    /// names as `params`.
    fn param_groups(&mut self) {
        let opt0 = &self.optims[0].1;
        for (g, hyper) in opt0.param_groups.iter().enumerate() {
            let mut entries: Vec<(String, crate::torch::pickle::Value)> = hyper.clone();
            let params = self
                .group_params(g)
                .into_iter()
                .map(|n| crate::torch::pickle::Value::Str(n.clone()))
                .collect();
            entries.push(("params".into(), crate::torch::pickle::Value::List(params)));
            for (k, v) in entries {
                let name = format!("optimizer.param_groups.{g}.{k}");
                self.paths.insert(
                    name.clone(),
                    vec![
                        KeyPart::Key("optimizer".into()),
                        KeyPart::Key("param_groups".into()),
                        KeyPart::Index(g as i64),
                        KeyPart::Key(k),
                    ],
                );
                self.extras.push(extra(name, v));
            }
        }
    }

    /// The parameter names of group `g`, in the group's own order (round_robin_gradients
    /// flattens them in another).
    fn group_params(&self, g: usize) -> Vec<&'a String> {
        let opt0 = &self.optims[0].1;
        let states = &self.models[0].1;
        let names: Vec<&String> = opt0.group_flats[g]
            .iter()
            .flat_map(|&k| &states.param_shapes[k])
            .map(|(n, _)| n)
            .collect();
        if !self.round_robin {
            return names;
        }
        let mut own = names.clone();
        for (j, i) in partition::round_robin(names.len(), self.dp)
            .into_iter()
            .enumerate()
        {
            own[i] = names[j];
        }
        own
    }

    /// The model states' other entries, and the ZeRO wrapper's scalars.
    fn extras(&mut self) -> Result<()> {
        let states = &self.models[0].1;
        for (k, v) in &states.others {
            if self.index.contains_key(k) {
                return Err(self.models[0]
                    .0
                    .err(format!("names `{}` as a tensor and as a value", short(k))));
            }
            self.extras.push(extra(k.clone(), v.clone()));
        }
        for (k, v) in &self.optims[0].1.scalars {
            self.extras
                .push(extra(format!("optimizer_state_dict.{k}"), v.clone()));
        }
        Ok(())
    }
}

/// Flat tensor `flat`'s optimizer state `key` in the optim file `f`.
fn state_tensor<'f>(
    f: &File,
    o: &'f OptimStates,
    flat: usize,
    key: &str,
) -> Result<&'f TensorItem> {
    match o.state[flat].iter().find(|(k, _)| k == key) {
        Some((_, StateEntry::Tensor(t))) => Ok(t),
        _ => Err(f.err(format!(
            "has no tensor `{}` in the optimizer state of flat tensor {flat}",
            short(key)
        ))),
    }
}

/// A non-tensor entry from a DeepSpeed file (ZeRO or universal).
pub(super) fn extra(name: String, v: crate::torch::pickle::Value) -> Extra {
    Extra {
        name,
        value: dcp::to_json(&v),
        pickle: Some(v),
        raw: None,
        origin: "deepspeed",
        opaque: None,
    }
}
