//! Bodies of reshard's fuzz targets, one function per target in `fuzz_targets/`.
//!
//! The same file is compiled into `tests/it/fuzz_regressions.rs` (`#[path]` module), which
//! replays the committed seeds (`fuzz/seeds/<target>/`) and every crash the fuzzers found
//! (`tests/fixtures/fuzz/<target>/`) through exactly these code paths, so `cargo test` keeps
//! them fixed.
//!
//! Every body must return normally on any input: a panic (including a failed assertion
//! below) is a crash. Errors must be one line (`Error`'s `Display` promises it), and a
//! checkpoint that opens must be readable tensor by tensor.
//!
//! Targets that need files write them in a scratch directory of their own, per process and
//! per thread, under `/dev/shm` when it exists (tmpfs: no disk traffic), else the system
//! temporary directory; directories left by processes that no longer run are removed when a
//! new one is made.
#![allow(clippy::missing_panics_doc)]

use reshard::formats::torch::{pickle as pk, save as tz};
use reshard::formats::{dcp, Checkpoint};
use reshard::layout::{DType, Region};
use reshard::target::LayoutSpec;
use std::cell::RefCell;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Largest tensor a target reads back whole. A valid checkpoint's tensors are bounded by its
/// files (DCP pieces may alias the same bytes, so not strictly); this only keeps one input
/// from taking seconds.
const MAX_READ: u64 = 64 << 20;

/// Panic unless `e` displays as one line.
pub fn assert_one_line(what: &str, e: &dyn Display) {
    let s = e.to_string();
    assert!(
        !s.contains('\n') && !s.contains('\r'),
        "{what}: the error is not one line: {s:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// pickle

fn globals() -> &'static [pk::Globals; 4] {
    static G: OnceLock<[pk::Globals; 4]> = OnceLock::new();
    G.get_or_init(|| {
        [
            pk::dcp_metadata_globals(),
            pk::torch_save_globals(),
            pk::pickled_dict_globals(),
            reshard::formats::deepspeed::records::globals().clone(),
        ]
    })
}

/// `pickle`: the pickle interpreter with each allow-list (DCP `.metadata`, torch.save
/// `data.pkl`, `meta.pt` / `common.pt` with Megatron-LM's arguments, DeepSpeed's files); a decoded value is also JSON-ified as `inspect` shows
/// non-tensor entries, made plain as the DeepSpeed reader makes it, and pickled again as the
/// writers pickle non-tensor entries.
pub fn pickle(data: &[u8]) {
    for g in globals() {
        match pk::parse(data, g) {
            Ok(v) => {
                let _ = dcp::to_json(&v);
                let _ = dcp::to_json(&reshard::formats::deepspeed::records::plain(&v));
                // made again as the writers make non-tensor entries (common.pt, meta.pt)
                if let Some(p) = pk::from_pickle(&v) {
                    let _ = pk::pickle(&p);
                }
            }
            Err(e) => assert_one_line("pickle", &e),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// torch.save zip

/// `torch_zip`: one torch.save archive (a DCP item, `meta.pt`, a `.pt` file) parsed from a
/// byte slice; every record of a parsed archive is located and CRC-checked, and a tensor's
/// extent must lie inside the slice.
pub fn torch_zip(data: &[u8]) {
    match tz::parse(data) {
        Ok(item) => {
            for e in &item.archive.entries {
                match item.archive.read_checked(data, &e.name) {
                    Ok(bytes) => assert!(bytes.len() as u64 == e.size),
                    Err(err) => assert_one_line("torch_zip record", &err),
                }
            }
            if let Some(t) = &item.tensor {
                let _ = t.is_row_major();
                let end = t.data_offset().checked_add(t.span_bytes());
                assert!(
                    end.is_some_and(|end| end <= data.len() as u64),
                    "tensor extent {:?}+{} outside the {}-byte slice",
                    t.data_offset(),
                    t.span_bytes(),
                    data.len()
                );
            }
        }
        Err(e) => assert_one_line("torch_zip", &e),
    }
}

// ---------------------------------------------------------------------------------------------
// scratch directories

/// A scratch directory of this process and thread, removed when the thread ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SCRATCH_PREFIX: &str = "reshard-fuzz-";

fn scratch_base() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// Remove `reshard-fuzz-<pid>-*` directories whose process is gone (libFuzzer ends with
/// `exit`, which runs no thread-local destructor).
fn remove_stale(base: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(rd) = std::fs::read_dir(base) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SCRATCH_PREFIX)) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// This thread's scratch directory (made on first use).
fn scratch() -> PathBuf {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.is_none() {
            static N: AtomicUsize = AtomicUsize::new(0);
            let base = scratch_base();
            remove_stale(&base);
            let dir = base.join(format!(
                "{SCRATCH_PREFIX}{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
            *s = Some(Scratch(dir));
        }
        s.as_ref().map(|s| s.0.clone()).unwrap_or_default()
    })
}

/// A fresh, empty subdirectory `name` of the scratch directory.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a fuzz directory");
    dir
}

// ---------------------------------------------------------------------------------------------
// opening checkpoints

/// Open `path`; when it opens, read every tensor whole (up to [`MAX_READ`]) and check the
/// reads succeed or fail with a one-line error. Returns whether it opened.
pub fn open_and_read(path: &Path) -> bool {
    match Checkpoint::open(path) {
        Ok(ck) => {
            for t in &ck.tensors {
                if t.nbytes() > MAX_READ {
                    continue;
                }
                match ck.read_region(&t.name, &Region::full(&t.shape), None) {
                    Ok(bytes) => assert_eq!(
                        bytes.len() as u64,
                        t.nbytes(),
                        "{}: tensor `{}` read {} bytes, expected {}",
                        path.display(),
                        t.name,
                        bytes.len(),
                        t.nbytes()
                    ),
                    Err(e) => assert_one_line("read_region", &e),
                }
            }
            true
        }
        Err(e) => {
            assert_one_line("Checkpoint::open", &e);
            false
        }
    }
}

// ---------------------------------------------------------------------------------------------
// safetensors

/// The file name the per-rank shards of `HuggingFaceStorageWriter` carry.
pub const SHARD_NAME: &str = "shard-00001-model-00001-of-00001.safetensors";

/// `safetensors_header`: the bytes as a safetensors file named like a per-rank shard
/// (`DCP_SHARDING_INFO` in its header is read); opened as a directory (HF storage layout) and
/// as a file (a single safetensors file, or a `.pt` when it starts with a zip signature).
pub fn safetensors_header(data: &[u8]) {
    let dir = fresh_dir("st");
    let file = dir.join(SHARD_NAME);
    std::fs::write(&file, data).expect("write the fuzz input");
    open_and_read(&dir);
    open_and_read(&file);
}

/// A small valid safetensors file: `(header json, data bytes)` assembled as the format says.
pub fn safetensors_bytes(tensors: &[(&str, &str, &[u64])]) -> Vec<u8> {
    let mut header = String::from("{");
    let mut off = 0u64;
    let mut data = vec![];
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let elem = match *dtype {
            "F64" | "I64" => 8,
            "F32" | "I32" => 4,
            "F16" | "BF16" | "I16" => 2,
            _ => 1,
        };
        let n = shape.iter().product::<u64>() * elem;
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{off},{}]}}"#,
            off + n
        ));
        data.extend((0..n).map(|b| (off + b) as u8));
        off += n;
    }
    header.push('}');
    while (8 + header.len()) % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend(data);
    out
}

/// The two shard files the `hf_index` target's index may name.
pub fn hf_files() -> [(&'static str, Vec<u8>); 2] {
    [
        (
            "model-00001-of-00002.safetensors",
            safetensors_bytes(&[
                ("embed.weight", "F32", &[4, 3]),
                ("norm.weight", "BF16", &[3]),
            ]),
        ),
        (
            "model-00002-of-00002.safetensors",
            safetensors_bytes(&[("head.weight", "F32", &[2, 3]), ("step", "I64", &[])]),
        ),
    ]
}

/// `hf_index`: a Hugging Face sharded directory whose `model.safetensors.index.json` is the
/// input, next to two small valid shard files ([`hf_files`]).
pub fn hf_index(data: &[u8]) {
    let dir = scratch().join("hf");
    if !dir.join(hf_files()[1].0).is_file() {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the hf directory");
        for (name, bytes) in hf_files() {
            std::fs::write(dir.join(name), bytes).expect("write an hf shard");
        }
    }
    std::fs::write(dir.join("model.safetensors.index.json"), data).expect("write the index");
    open_and_read(&dir);
}

// ---------------------------------------------------------------------------------------------
// layout files

/// Largest target world a layout input is compiled for (compiling is linear in the world
/// size; a mesh of 2^32 ranks is a valid request, just not one to make per fuzz input).
const MAX_WORLD: u64 = 4096;

/// The tensors a layout input is compiled for: scalar, empty, uneven 1-d to 3-d.
fn layout_tensors() -> Vec<(String, DType, Vec<u64>)> {
    [
        ("model.embed.weight", DType::F32, vec![10, 12]),
        ("model.blocks.0.qkv.weight", DType::BF16, vec![36, 12]),
        ("model.blocks.0.qkv.bias", DType::BF16, vec![36]),
        ("model.logit_scale", DType::F32, vec![1]),
        ("optimizer.state.step", DType::F32, vec![]),
        ("model.conv", DType::F16, vec![3, 5, 7]),
        ("model.empty", DType::F32, vec![0, 4]),
    ]
    .into_iter()
    .map(|(n, d, s)| (n.to_string(), d, s))
    .collect()
}

/// Visit the row-major indices of the elements of `r` inside a tensor of `shape`.
fn for_each_index(shape: &[u64], r: &Region, mut f: impl FnMut(usize)) {
    if r.is_empty() {
        return;
    }
    let nd = shape.len();
    let mut idx = r.offsets.clone();
    loop {
        let flat = shape.iter().zip(&idx).fold(0u64, |a, (&n, &i)| a * n + i);
        f(flat as usize);
        // advance
        let mut d = nd;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < r.offsets[d] + r.sizes[d] {
                break;
            }
            idx[d] = r.offsets[d];
        }
    }
}

/// `layout`: a layout file (`--layout`, [`LayoutSpec::from_json`] as `from_file` reads it):
/// parsed, checked, and when valid compiled for a few
/// tensors; every rank's regions must lie inside the tensor and together cover it, each
/// element exactly once in a flat layout.
pub fn layout(data: &[u8]) {
    let spec = match LayoutSpec::from_json(data) {
        Ok(s) => s,
        Err(e) => {
            assert_one_line("LayoutSpec::from_json", &e);
            return;
        }
    };
    let world = spec.world();
    if world > MAX_WORLD {
        return;
    }
    let tensors = layout_tensors();
    let compiled = match spec.compile(&tensors) {
        Ok(c) => c,
        Err(e) => {
            assert_one_line("LayoutSpec::compile", &e);
            return;
        }
    };
    assert_eq!(compiled.len(), tensors.len());
    for (t, (name, _, shape)) in compiled.iter().zip(&tensors) {
        assert_eq!(&t.name, name);
        assert_eq!(t.ranks.len() as u64, world, "`{name}`: one entry per rank");
        let full = Region::full(shape);
        let mut seen = vec![0u32; full.volume() as usize];
        for (r, regions) in t.ranks.iter().enumerate() {
            for g in regions {
                assert!(
                    g.ndim() == shape.len() && full.contains(g),
                    "`{name}` rank {r}: region {g} outside shape {shape:?}"
                );
                for_each_index(shape, g, |i| seen[i] += 1);
            }
        }
        if spec.flat {
            assert!(
                seen.iter().all(|&c| c == 1),
                "`{name}`: a flat layout must hold every element exactly once: {seen:?}"
            );
        } else {
            assert!(
                seen.iter().all(|&c| c >= 1),
                "`{name}`: an element no rank holds: {seen:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// whole checkpoints: DCP and DeepSpeed

/// The small real DCP checkpoints `open_dcp` mutates, relative to the repository root:
/// plain FSDP2, zstd-compressed items, safetensors-serialized items, torch 2.1 Fabric
/// (`meta.pt`, 2.1 metadata classes), and megatron-core folders (0.16: save plans in the
/// metadata, `common.pt`, `metadata.json`; 0.15: `MCoreMetadata` and flattened tensors).
pub const DCP_FIXTURES: [&str; 6] = [
    "tests/fixtures/fsdp2_w2_f32/checkpoint",
    "tests/fixtures/fsdp2_w2_f32_zstd/checkpoint",
    "tests/fixtures/fmt_fs_safetensors_w2/checkpoint",
    "tests/fixtures/fabric_fsdp1_w4_f32_torch21/checkpoint",
    "tests/fixtures/megatron/mcore016_tp2_dp2/checkpoint",
    "tests/fixtures/megatron/mcore015_tp2_dp1_flat/checkpoint",
];

/// The DeepSpeed tag folders `open_deepspeed` mutates: one per optimizer layout (stage 1
/// with a tied parameter, BF16_Optimizer, stage 2 bf16 with a frozen parameter, stage 3
/// with frozen fragments and sub-groups).
pub const DEEPSPEED_FIXTURES: [&str; 4] = [
    "tests/fixtures/deepspeed/zero1_dp2_f32_g1/checkpoint/global_step2",
    "tests/fixtures/deepspeed/zero1_dp2_bf16_g2_fp32acc/checkpoint/global_step2",
    "tests/fixtures/deepspeed/zero2_dp3_bf16_g1/checkpoint/global_step2",
    "tests/fixtures/deepspeed/zero3_dp2_f32_g2_sub/checkpoint/global_step2",
];

/// The fixtures of `open_producers`, relative to the repository root: a DeepSpeed universal
/// checkpoint (a folder per parameter), verl's per-rank FSDP2 files (with `huggingface/`), a
/// torch_checkpointing folder, Megatron-LM's legacy rank folders with the distributed
/// optimizer's `distrib_optim.pt`, and without, and a Megatron-FSDP `fsdp_dtensor` save
/// directory (DCP files whose `args` item says so). A file index takes the low nibble: only a
/// fixture's first 16 files (a folder's own files first) are reached.
pub const PRODUCER_FIXTURES: [&str; 6] = [
    "tests/fixtures/deepspeed_universal/zero3_dp2_f32_g2_sub/global_step2_universal",
    "tests/fixtures/verl/fsdp2_w2/checkpoint",
    "tests/fixtures/torch_checkpointing/fsdp2_w2/checkpoint",
    "tests/fixtures/megatron_distopt/legacy",
    "tests/fixtures/megatron_legacy/tp2/checkpoint",
    "tests/fixtures/megatron_fsdp/llama_tp2_fsdp2/fsdp_dtensor",
];

/// The repository root: the crate's own directory when this file is compiled into the
/// root crate's tests, its parent when it is compiled as the fuzz crate (`fuzz/`).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    [manifest.to_path_buf(), manifest.join("..")]
        .into_iter()
        .find(|p| p.join("tests/fixtures").is_dir())
        .expect("the repository's tests/fixtures")
}

/// The files of a fixture directory, its sub-folders' included, sorted by depth and then by
/// their path relative to it (a folder's own files first): `(path, bytes)`.
fn fixture_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        for e in std::fs::read_dir(dir)
            .expect("read a fixture checkpoint")
            .flatten()
        {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.is_file() {
                let rel = p.strip_prefix(root).expect("under the fixture");
                out.push((
                    rel.to_string_lossy().into_owned(),
                    std::fs::read(&p).expect("read a fixture file"),
                ));
            }
        }
    }
    let mut v = vec![];
    walk(dir, dir, &mut v);
    v.sort_by(|a, b| (a.0.matches('/').count(), &a.0).cmp(&(b.0.matches('/').count(), &b.0)));
    v
}

/// The files of one fixture checkpoint: (name, bytes).
type FixtureFiles = Vec<(String, Vec<u8>)>;

/// A set of fixture checkpoints a whole-checkpoint target mutates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Set {
    /// [`DCP_FIXTURES`], for `open_dcp`.
    Dcp,
    /// [`DEEPSPEED_FIXTURES`], for `open_deepspeed`.
    DeepSpeed,
    /// [`PRODUCER_FIXTURES`], for `open_producers`.
    Producers,
}

impl Set {
    /// The fixture directories, relative to the repository root.
    pub fn dirs(self) -> &'static [&'static str] {
        match self {
            Set::Dcp => &DCP_FIXTURES,
            Set::DeepSpeed => &DEEPSPEED_FIXTURES,
            Set::Producers => &PRODUCER_FIXTURES,
        }
    }

    fn files(self) -> &'static Vec<FixtureFiles> {
        static DCP: OnceLock<Vec<FixtureFiles>> = OnceLock::new();
        static DS: OnceLock<Vec<FixtureFiles>> = OnceLock::new();
        static PRODUCERS: OnceLock<Vec<FixtureFiles>> = OnceLock::new();
        let cell = match self {
            Set::Dcp => &DCP,
            Set::DeepSpeed => &DS,
            Set::Producers => &PRODUCERS,
        };
        cell.get_or_init(|| {
            let root = repo_root();
            self.dirs()
                .iter()
                .map(|d| fixture_files(&root.join(d)))
                .collect()
        })
    }

    /// The selector byte for file `file` of fixture `fixture`.
    pub fn selector(self, fixture: usize, file: usize) -> u8 {
        ((fixture as u8) << 4) | file as u8
    }

    /// Which fixture and file a selector byte picks: `(fixture, file)`.
    pub fn pick(self, sel: u8) -> (usize, usize) {
        let fx = self.files();
        let f = (sel >> 4) as usize % fx.len();
        (f, (sel & 0x0f) as usize % fx[f].len())
    }

    /// The names of the files of fixture `fixture`, as [`Set::selector`] numbers them.
    pub fn file_names(self, fixture: usize) -> Vec<String> {
        self.files()[fixture]
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The original bytes of file `file` of fixture `fixture`.
    pub fn file(self, fixture: usize, file: usize) -> &'static [u8] {
        &self.files()[fixture][file].1
    }
}

/// The whole open path on a small real checkpoint of `set`. The first byte picks a fixture
/// (high nibble) and one of its files (low nibble); the rest replaces that file. The
/// checkpoint is opened and, when it opens, every tensor read; then opened lazily, every
/// tensor read again, the bytes the same as the eager reads'.
fn open_replaced(set: Set, data: &[u8]) {
    let Some((&sel, content)) = data.split_first() else {
        return;
    };
    let (fi, file) = set.pick(sel);
    let fixture = &set.files()[fi];
    let dir = scratch().join(format!("{set:?}{fi}"));
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir).expect("create a fixture copy");
        for (name, bytes) in fixture {
            let p = dir.join(name);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).expect("create a fixture sub-folder");
            }
            std::fs::write(p, bytes).expect("copy a fixture file");
        }
    }
    let (name, original) = &fixture[file];
    let path = dir.join(name);
    std::fs::write(&path, content).expect("write the fuzz input");
    let eager = open_and_read(&dir);
    lazy_agrees(&dir, eager);
    std::fs::write(&path, original).expect("restore a fixture file");
}

/// `open_dcp`: [`open_replaced`] on [`DCP_FIXTURES`].
pub fn open_dcp(data: &[u8]) {
    open_replaced(Set::Dcp, data)
}

/// `open_deepspeed`: [`open_replaced`] on [`DEEPSPEED_FIXTURES`] (tag folders: model states
/// and optim files, whose pickles name DeepSpeed's classes).
pub fn open_deepspeed(data: &[u8]) {
    open_replaced(Set::DeepSpeed, data)
}

/// `open_producers`: [`open_replaced`] on [`PRODUCER_FIXTURES`] (the pickles of DeepSpeed
/// universal checkpoints, verl's DTensor shards, torch_checkpointing's `metadata.pkl`,
/// Megatron-LM's arguments and `distrib_optim.pt`).
pub fn open_producers(data: &[u8]) {
    open_replaced(Set::Producers, data)
}

/// The lazy open of `dir` ([`Checkpoint::open_lazy`]): errors are one line, and when the eager
/// open succeeded (`eager`), the lazy one does too and reads every tensor to the same bytes.
fn lazy_agrees(dir: &Path, eager: bool) {
    let lazy = match Checkpoint::open_lazy(dir, None) {
        Ok(ck) => ck,
        Err(e) => {
            assert!(
                !eager,
                "{}: the eager open succeeded, the lazy one failed: {e}",
                dir.display()
            );
            assert_one_line("Checkpoint::open_lazy", &e);
            return;
        }
    };
    let ck = eager.then(|| Checkpoint::open(dir).expect("opened a moment ago"));
    for t in &lazy.tensors {
        if t.nbytes() > MAX_READ {
            continue;
        }
        let full = Region::full(&t.shape);
        let got = lazy.read_region(&t.name, &full, None);
        if let Err(e) = &got {
            assert_one_line("read_region (lazy)", e);
        }
        if let Some(ck) = &ck {
            let want = ck.read_region(&t.name, &full, None);
            assert_eq!(
                got.as_ref().ok(),
                want.as_ref().ok(),
                "{}: tensor `{}` read lazily and eagerly differ ({:?} / {:?})",
                dir.display(),
                t.name,
                got.as_ref().err(),
                want.as_ref().err()
            );
        }
    }
}
