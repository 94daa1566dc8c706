//! Resource bounds on hostile checkpoints (issue 6): metadata claiming a tensor of 2^60
//! elements (and more than 2^64), a million chunks, deeply nested pickles and JSON. Each
//! ends in a clear one-line error (or, where the checkpoint is legitimately valid, a
//! complete conversion) within bounded time and memory: the CLI runs as a child under a
//! virtual-memory cap (`ulimit -v`, a safety net), its peak RSS is read with `wait4`, and
//! both are asserted (< 10 s, < 1 GiB).
//!
//! A test binary of its own (not a module of `tests/it`): the time and memory it asserts are
//! measured with no other tests loading the CPU.

mod common;

use common::s;
use reshard::formats::torch::pickle::{pickle, PyValue};
use reshard::formats::torch::save::{save_to_vec, standard_records, TensorRef};
use reshard::formats::torch::zip::{archive_bytes, layout_archive};
use reshard::layout::DType;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_reshard");
const TIME_LIMIT: Duration = Duration::from_secs(10);
const RSS_LIMIT: u64 = 1 << 30;

/// How a bounded run ended.
struct Run {
    code: Option<i32>,
    stderr: String,
    secs: f64,
    /// Peak resident set size in bytes.
    rss: u64,
}

/// Run the CLI with `args` under an 8 GiB address-space cap, killing it past 60 s; report
/// its exit, stderr, wall time and peak RSS.
// The child is reaped with `wait4` (for its rusage), not `Child::wait`.
#[allow(clippy::zombie_processes)]
fn bounded(args: &[&str]) -> Run {
    // One bounded run at a time, so that runs measured in parallel tests do not slow each
    // other down.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let err_path = tempfile::NamedTempFile::new().unwrap().into_temp_path();
    let err_file = std::fs::File::create(&err_path).unwrap();
    let child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 8388608; exec \"$0\" \"$@\"")
        .arg(BIN)
        .args(args)
        .stdout(Stdio::null())
        .stderr(err_file)
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let t0 = Instant::now();
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value to be filled in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waiting for our own child with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid {
            break;
        }
        assert_eq!(r, 0, "wait4: {}", std::io::Error::last_os_error());
        if t0.elapsed() > Duration::from_secs(60) {
            // SAFETY: killing our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above.
            unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
            panic!("reshard {args:?} still running after 60 s: killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let secs = t0.elapsed().as_secs_f64();
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Run {
        code,
        stderr: std::fs::read_to_string(&err_path).unwrap(),
        secs,
        rss: ru.ru_maxrss as u64 * 1024,
    }
}

/// Require a bounded failure: exit 2, one line, containing every needle.
fn fails_bounded(what: &str, args: &[&str], needles: &[&str]) {
    let r = bounded(args);
    eprintln!(
        "{what}: exit {:?} in {:.2} s, peak RSS {} MiB: {}",
        r.code,
        r.secs,
        r.rss >> 20,
        r.stderr.trim()
    );
    assert_eq!(r.code, Some(2), "{what}: {}", r.stderr);
    assert_eq!(
        r.stderr.trim_end().lines().count(),
        1,
        "not one line: {}",
        r.stderr
    );
    assert!(r.stderr.starts_with("reshard: error: "), "{}", r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{what}: `{n}` not in: {}", r.stderr);
    }
    assert!(!r.stderr.contains("internal error"), "{what}: {}", r.stderr);
    within_bounds(what, &r);
}

fn within_bounds(what: &str, r: &Run) {
    within_scaled_bounds(what, r, 0);
}

/// Time and memory a run may take per byte of metadata it reads, on top of the fixed
/// bounds: linear in the input (a quadratic step or an amplification fails it).
const SECS_PER_INPUT_MB: f64 = 1.0;
const RSS_PER_INPUT_BYTE: u64 = 48;

/// The fixed bounds plus an allowance linear in `input` (bytes of metadata that are
/// legitimately large, e.g. a million distinct chunks).
fn within_scaled_bounds(what: &str, r: &Run, input: u64) {
    let secs = TIME_LIMIT.as_secs_f64() + SECS_PER_INPUT_MB * input as f64 / 1e6;
    let rss = RSS_LIMIT + RSS_PER_INPUT_BYTE * input;
    assert!(
        r.secs < secs,
        "{what}: took {:.1} s (bound {secs:.1} s)",
        r.secs
    );
    assert!(
        r.rss < rss,
        "{what}: peak RSS {} MiB (bound {} MiB)",
        r.rss >> 20,
        rss >> 20
    );
}

// ---------------------------------------------------------------------------------------------
// Building DCP metadata (the torch 2.1 class layout reshard writes, see crates/formats/src/dcp/write.rs)

use reshard::formats::dcp::write::{tensor_properties, FS, META, ST_META};

fn properties() -> PyValue {
    tensor_properties(reshard::layout::DType::F32)
}

/// One chunk: (offsets, sizes) and where its item is: (file, offset, length).
type ChunkSpec = (Vec<u64>, Vec<u64>, (String, u64, u64));

/// A `.metadata` pickle for one f32 tensor `name` of `shape` with `chunks`.
fn metadata(name: &str, shape: &[u64], chunks: &[ChunkSpec]) -> Vec<u8> {
    let mut storage = vec![];
    let mut list = vec![];
    for (i, (offsets, sizes, (file, at, len))) in chunks.iter().enumerate() {
        list.push(PyValue::object(
            META,
            "ChunkStorageMetadata",
            Some(PyValue::str_dict(vec![
                ("offsets", PyValue::torch_size(offsets)),
                ("sizes", PyValue::torch_size(sizes)),
            ])),
        ));
        storage.push((
            PyValue::object(
                META,
                "MetadataIndex",
                Some(PyValue::str_dict(vec![
                    ("fqn", PyValue::Str(name.into())),
                    ("offset", PyValue::torch_size(offsets)),
                    ("index", PyValue::Int(i as i64)),
                ])),
            ),
            PyValue::object(
                FS,
                "_StorageInfo",
                Some(PyValue::str_dict(vec![
                    ("relative_path", PyValue::Str(file.clone())),
                    ("offset", PyValue::Int(*at as i64)),
                    ("length", PyValue::Int(*len as i64)),
                ])),
            ),
        ));
    }
    let sdm = vec![(
        PyValue::Str(name.into()),
        PyValue::object(
            META,
            "TensorStorageMetadata",
            Some(PyValue::str_dict(vec![
                ("properties", properties()),
                ("size", PyValue::torch_size(shape)),
                ("chunks", PyValue::List(list)),
            ])),
        ),
    )];
    pickle(&PyValue::object(
        META,
        "Metadata",
        Some(PyValue::str_dict(vec![
            ("state_dict_metadata", PyValue::Dict(sdm)),
            ("planner_data", PyValue::Dict(vec![])),
            ("storage_data", PyValue::Dict(storage)),
        ])),
    ))
}

/// A torch.save item holding an f32 tensor of `shape` whose storage has `bytes` bytes.
fn tensor_item(shape: &[u64], bytes: usize) -> Vec<u8> {
    save_to_vec(
        "archive",
        &PyValue::Tensor(TensorRef::new("0", DType::F32, shape.to_vec())),
        &[("0".to_string(), vec![0x3f; bytes])],
    )
}

/// A torch.save archive whose `data.pkl` is `pkl` (no storages).
fn archive_with_pickle(prefix: &str, pkl: Vec<u8>) -> Vec<u8> {
    let records = standard_records(pkl, &[]);
    let layout = layout_archive(prefix, &records);
    let mut out = vec![0u8; layout.len as usize];
    for (at, bytes) in archive_bytes(&layout, &records, &vec![0; records.len()]) {
        out[at as usize..at as usize + bytes.len()].copy_from_slice(&bytes);
    }
    out
}

/// A DCP directory `dir` with `.metadata` and `__0_0.distcp` as given.
fn dcp(dir: &Path, meta: &[u8], data: &[u8]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(".metadata"), meta).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), data).unwrap();
    dir.to_path_buf()
}

fn item_at(len: usize) -> (String, u64, u64) {
    ("__0_0.distcp".to_string(), 0, len as u64)
}

// ---------------------------------------------------------------------------------------------

#[test]
fn a_tensor_of_2_pow_60_elements_is_refused_quickly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    let g = 1u64 << 30; // 2^30 x 2^30 = 2^60 elements
    let item = tensor_item(&[4], 16);

    // The metadata claims 2^60 elements in one chunk; the item holds 4.
    let ck = dcp(
        &tmp.path().join("a"),
        &metadata(
            "w",
            &[g, g],
            &[(vec![0, 0], vec![g, g], item_at(item.len()))],
        ),
        &item,
    );
    for cmd in [
        vec!["inspect", s(&ck)],
        vec!["convert", s(&ck), s(&out), "--to", "1"],
    ] {
        fails_bounded(
            "2^60 elements, item of 4",
            &cmd,
            &["__0_0.distcp", "`w`", "shape"],
        );
    }

    // The item agrees (its pickle claims 2^60 elements) but its storage has 16 bytes.
    let item = tensor_item(&[g, g], 16);
    let ck = dcp(
        &tmp.path().join("b"),
        &metadata(
            "w",
            &[g, g],
            &[(vec![0, 0], vec![g, g], item_at(item.len()))],
        ),
        &item,
    );
    fails_bounded(
        "2^60 elements in metadata and item",
        &["convert", s(&ck), s(&out), "--to", "1"],
        &["__0_0.distcp"],
    );

    // 2^60 elements of which the metadata lists no chunk.
    let ck = dcp(&tmp.path().join("c"), &metadata("w", &[g, g], &[]), &item);
    fails_bounded(
        "2^60 elements, no chunk",
        &["convert", s(&ck), s(&out), "--to", "1"],
        &[".metadata", "`w`", "not covered"],
    );

    // More than 2^64 elements (2^31 cubed): the element count overflows u64.
    let h = 1u64 << 31;
    let ck = dcp(
        &tmp.path().join("e"),
        &metadata("w", &[h, h, h], &[]),
        &item,
    );
    fails_bounded(
        "2^93 elements",
        &["convert", s(&ck), s(&out), "--to", "1"],
        &[".metadata", "`w`", "is too large"],
    );
    // ... in one chunk, whose item holds 2^60 elements in 16 bytes.
    let ck = dcp(
        &tmp.path().join("f"),
        &metadata(
            "w",
            &[h, h, h],
            &[(vec![0, 0, 0], vec![h, h, h], item_at(item.len()))],
        ),
        &item,
    );
    fails_bounded(
        "2^93 elements in metadata and item",
        &["convert", s(&ck), s(&out), "--to", "1"],
        &["__0_0.distcp", "`w`"],
    );

    // A safetensors header claiming 2^60 elements for 16 bytes of data.
    let st = tmp.path().join("huge.safetensors");
    let header = format!(r#"{{"w":{{"dtype":"F32","shape":[{g},{g}],"data_offsets":[0,16]}}}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 16]);
    std::fs::write(&st, &bytes).unwrap();
    fails_bounded(
        "safetensors header of 2^60 elements",
        &["convert", s(&st), s(&out), "--to", "1"],
        &["huge.safetensors"],
    );
    assert!(!out.exists());
    assert_eq!(
        common::names(tmp.path())
            .iter()
            .filter(|n| n.contains("reshard"))
            .count(),
        0
    );
}

// ---------------------------------------------------------------------------------------------
// A protocol-2 pickle emitter with a memo, as Python's pickler writes (globals and repeated
// strings are written once and fetched with LONG_BINGET): compact million-chunk metadata.

#[derive(Default)]
struct Pickler {
    out: Vec<u8>,
    memo: std::collections::HashMap<String, u32>,
}

impl Pickler {
    fn new() -> Self {
        let mut p = Pickler::default();
        p.out.extend_from_slice(b"\x80\x02");
        p
    }
    fn memo_get_or(&mut self, key: String, emit: impl FnOnce(&mut Vec<u8>)) {
        if let Some(&i) = self.memo.get(&key) {
            self.out.push(b'j');
            self.out.extend_from_slice(&i.to_le_bytes());
        } else {
            emit(&mut self.out);
            let i = self.memo.len() as u32;
            self.out.push(b'r');
            self.out.extend_from_slice(&i.to_le_bytes());
            self.memo.insert(key, i);
        }
    }
    fn global(&mut self, module: &str, name: &str) {
        self.memo_get_or(format!("g:{module}.{name}"), |o| {
            o.push(b'c');
            o.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
        });
    }
    fn str_(&mut self, s: &str) {
        self.memo_get_or(format!("s:{s}"), |o| {
            o.push(b'X');
            o.extend_from_slice(&(s.len() as u32).to_le_bytes());
            o.extend_from_slice(s.as_bytes());
        });
    }
    fn int(&mut self, i: u64) {
        if i < 256 {
            self.out.extend_from_slice(&[b'K', i as u8]);
        } else if i < (1 << 31) {
            self.out.push(b'J');
            self.out.extend_from_slice(&(i as i32).to_le_bytes());
        } else {
            self.out.extend_from_slice(&[0x8a, 8]);
            self.out.extend_from_slice(&i.to_le_bytes());
        }
    }
    fn op(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }
    /// `torch.Size((v...))`
    fn size(&mut self, v: &[u64]) {
        self.global("torch", "Size");
        self.op(b"(");
        for &x in v {
            self.int(x);
        }
        self.op(b"t\x85R");
    }
    /// `module.name.__new__(module.name)` then BUILD with a dict state filled by `fill`.
    fn object(&mut self, module: &str, name: &str, fill: impl FnOnce(&mut Self)) {
        self.global(module, name);
        self.op(b")\x81}(");
        fill(self);
        self.op(b"ub");
    }
    fn finish(mut self) -> Vec<u8> {
        self.out.push(b'.');
        self.out
    }
}

/// How [`chunk_metadata`] lists the chunks of its tensor.
#[derive(Clone, Copy, PartialEq)]
enum Chunks {
    /// Chunks `range` of `n` one-element chunks, each with its storage entry (all stored in
    /// the same item): a valid checkpoint.
    Distinct,
    /// The same, with no storage entry at all.
    NoStorage,
    /// One chunk object listed `n` times through the memo (LONG_BINGET, 5 bytes each), with
    /// one storage entry: a few MB that expand to `n` chunks.
    Repeated,
}

/// `.metadata` for an f32 tensor `w` of `n` elements (1 for [`Chunks::Repeated`]) whose
/// chunks `range` are listed as `how` says, stored in the item (`__0_0.distcp`, 0, `len`).
fn chunk_metadata(n: u64, range: std::ops::Range<u64>, len: u64, how: Chunks) -> Vec<u8> {
    let mut p = Pickler::new();
    let shape = if how == Chunks::Repeated { 1 } else { n };
    let chunk = |p: &mut Pickler, i: u64| {
        p.object(META, "ChunkStorageMetadata", |p| {
            p.str_("offsets");
            p.size(&[i]);
            p.str_("sizes");
            p.size(&[1]);
        })
    };
    let entry = |p: &mut Pickler, i: u64| {
        p.object(META, "MetadataIndex", |p| {
            p.str_("fqn");
            p.str_("w");
            p.str_("offset");
            p.size(&[i]);
            p.str_("index");
            p.int(i);
        });
        p.object(FS, "_StorageInfo", |p| {
            p.str_("relative_path");
            p.str_("__0_0.distcp");
            p.str_("offset");
            p.int(0);
            p.str_("length");
            p.int(len);
        });
    };
    p.object(META, "Metadata", |p| {
        p.str_("state_dict_metadata");
        p.op(b"}");
        p.str_("w");
        p.object(META, "TensorStorageMetadata", |p| {
            p.str_("properties");
            p.global(ST_META, "TensorProperties");
            p.op(b")\x81(");
            p.global("torch", "float32");
            p.global("torch.serialization", "_get_layout");
            p.str_("torch.strided");
            p.op(b"\x85R\x89");
            p.global(ST_META, "MEM_FORMAT_ENCODING");
            p.int(0);
            p.op(b"\x85R\x89tb");
            p.str_("size");
            p.size(&[shape]);
            p.str_("chunks");
            p.op(b"]");
            let mut memo = None;
            for (k, i) in range.clone().enumerate() {
                if k % 1000 == 0 {
                    p.op(b"(");
                }
                match (how, memo) {
                    (Chunks::Repeated, Some(m)) => {
                        p.op(b"j");
                        p.op(&u32::to_le_bytes(m));
                    }
                    (Chunks::Repeated, None) => {
                        chunk(p, 0);
                        let m = p.memo.len() as u32;
                        p.op(b"r");
                        p.op(&m.to_le_bytes());
                        p.memo.insert("chunk".into(), m);
                        memo = Some(m);
                    }
                    _ => chunk(p, i),
                }
                if k % 1000 == 999 || i == range.end - 1 {
                    p.op(b"e");
                }
            }
        });
        p.op(b"s");
        p.str_("planner_data");
        p.op(b"}");
        p.str_("storage_data");
        p.op(b"}");
        match how {
            Chunks::Distinct => {
                for (k, i) in range.clone().enumerate() {
                    if k % 1000 == 0 {
                        p.op(b"(");
                    }
                    entry(p, i);
                    if k % 1000 == 999 || i == range.end - 1 {
                        p.op(b"u");
                    }
                }
            }
            Chunks::Repeated => {
                entry(p, 0);
                p.op(b"s");
            }
            Chunks::NoStorage => {}
        }
    });
    p.finish()
}

/// A scratch directory: `$RESHARD_BOUNDS_DIR/NAME` when that is set (kept, to replay a case
/// by hand), otherwise a temporary one.
fn scratch(name: &str) -> (Option<tempfile::TempDir>, PathBuf) {
    match std::env::var_os("RESHARD_BOUNDS_DIR") {
        Some(d) => {
            let d = PathBuf::from(d).join(name);
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            (None, d)
        }
        None => {
            let t = tempfile::tempdir().unwrap();
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    }
}

const MILLION: u64 = 1_000_000;

/// Run `args`, which must complete or fail with one clear line, within the bounds for
/// `input` bytes of metadata.
fn ends_within_bounds(what: &str, args: &[&str], input: u64) -> Run {
    let r = bounded(args);
    eprintln!(
        "{what}: exit {:?} in {:.2} s, peak RSS {} MiB: {}",
        r.code,
        r.secs,
        r.rss >> 20,
        r.stderr.trim()
    );
    if r.code != Some(0) {
        assert_eq!(r.code, Some(2), "{what}: {}", r.stderr);
        assert_eq!(r.stderr.trim_end().lines().count(), 1, "{}", r.stderr);
        assert!(!r.stderr.contains("internal error"), "{}", r.stderr);
    }
    within_scaled_bounds(what, &r, input);
    r
}

/// A 5 MB `.metadata` listing one chunk a million times through the memo: the fixed bounds
/// (the input is small): refused in 0.15 s ("pickle expands beyond 10005854 values"); it took
/// 21 s and 1.3 GiB before `VALUES_PER_INPUT_BYTE` went from 16 to 2.
#[test]
fn a_million_chunks_repeated_through_the_memo_end_within_bounds() {
    let (_keep, tmp) = scratch("repeated");
    let item = tensor_item(&[1], 4);
    let meta = chunk_metadata(MILLION, 0..MILLION, item.len() as u64, Chunks::Repeated);
    eprintln!("repeated-chunk .metadata: {} KiB", meta.len() >> 10);
    let ck = dcp(&tmp.join("ck"), &meta, &item);
    let out = tmp.join("out.safetensors");
    let r = ends_within_bounds(
        "a million copies of one chunk",
        &["convert", s(&ck), s(&out), "--to", "1", "-q"],
        0,
    );
    if r.code == Some(0) {
        assert_eq!(common::read_safetensors(&out)["w"].data, [0x3f; 4]);
    }
}

/// A million distinct chunks (a 45 MB `.metadata`) and no storage entry for any: refused
/// within bounds linear in the metadata's size (about 10 s and 1.6 GiB here).
#[test]
fn a_million_chunks_without_storage_are_refused_within_bounds() {
    let (_keep, tmp) = scratch("nostorage");
    let item = tensor_item(&[1], 4);
    let meta = chunk_metadata(MILLION, 0..MILLION, item.len() as u64, Chunks::NoStorage);
    eprintln!(
        "storage-less million-chunk .metadata: {} MiB",
        meta.len() >> 20
    );
    let ck = dcp(&tmp.join("ck"), &meta, &item);
    let r = ends_within_bounds(
        "a million chunks without storage",
        &["inspect", s(&ck)],
        meta.len() as u64,
    );
    assert_eq!(r.code, Some(2));
    for n in [".metadata", "no storage_data entry for chunk [0:1] of `w`"] {
        assert!(r.stderr.contains(n), "`{n}` not in {}", r.stderr);
    }
}

/// A valid checkpoint of a million one-element chunks (a 130 MB `.metadata`, all chunks
/// stored in one 4-byte item): `convert` completes or fails clearly within bounds linear in
/// the metadata's size. About a minute and 4.2 GiB here (the pickle reader decodes about
/// 5 MB/s into a tree of 80-byte values, then each chunk's item is parsed): too slow for
/// CI; run it with `--ignored`.
#[test]
#[ignore = "about a minute and 4.2 GiB (issue 6 note); run with --ignored"]
fn a_million_distinct_chunks_end_within_bounds() {
    let (_keep, tmp) = scratch("distinct");
    let item = tensor_item(&[1], 4);
    let meta = chunk_metadata(MILLION, 0..MILLION, item.len() as u64, Chunks::Distinct);
    eprintln!("million-chunk .metadata: {} MiB", meta.len() >> 20);
    let ck = dcp(&tmp.join("ck"), &meta, &item);
    let input = meta.len() as u64;
    drop(meta);
    let out = tmp.join("out.safetensors");
    let r = ends_within_bounds(
        "a million chunks",
        &["convert", s(&ck), s(&out), "--to", "1", "-q"],
        input,
    );
    if r.code == Some(0) {
        let got = common::read_safetensors(&out);
        assert_eq!(got["w"].shape, vec![MILLION as usize]);
        assert!(got["w"].data.chunks(4).all(|c| c == [0x3f; 4]));
    }
}

/// use_collectives=False: two per-rank metadata files of 100k chunks each, merged by
/// reshard. The merge de-duplicates chunks with a hash set (about 9 s here; the linear search
/// it replaced took over 5 minutes for these 200k chunks).
#[test]
fn per_rank_metadata_with_many_chunks_merge_within_bounds() {
    let (_keep, tmp) = scratch("perrank");
    let item = tensor_item(&[1], 4);
    let n = 200_000;
    let ck = tmp.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    let mut input = 0;
    for (r, range) in [(0, 0..n / 2), (1, n / 2..n)] {
        let meta = chunk_metadata(n, range, item.len() as u64, Chunks::Distinct);
        input += meta.len() as u64;
        std::fs::write(ck.join(format!("__{r}.metadata")), meta).unwrap();
    }
    std::fs::write(ck.join("__0_0.distcp"), &item).unwrap();
    let r = ends_within_bounds(
        "200k chunks in two per-rank files",
        &["inspect", s(&ck)],
        input,
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

// ---------------------------------------------------------------------------------------------
// Deep nesting

/// `depth` nested empty lists: `[[[...]]]`, built with EMPTY_LIST and APPEND.
fn nested_lists(depth: usize) -> Vec<u8> {
    let mut v = b"\x80\x02".to_vec();
    v.extend(std::iter::repeat_n(b']', depth));
    v.extend(std::iter::repeat_n(b'a', depth - 1));
    v.push(b'.');
    v
}

/// `depth` nested tuples opened with MARK: `((((...))))`.
fn nested_marks(depth: usize) -> Vec<u8> {
    let mut v = b"\x80\x02".to_vec();
    v.extend(std::iter::repeat_n(b'(', depth));
    v.extend(std::iter::repeat_n(b't', depth));
    v.push(b'.');
    v
}

/// `depth` nested dicts `{"k": {"k": ...}}`.
fn nested_dicts(depth: usize) -> Vec<u8> {
    let mut v = b"\x80\x02".to_vec();
    for _ in 0..depth {
        v.extend_from_slice(b"}X\x01\x00\x00\x00k");
    }
    v.push(b'}');
    v.extend(std::iter::repeat_n(b's', depth));
    v.push(b'.');
    v
}

/// A list of two references to the previous list, `levels` times: 2^levels leaves from a
/// few hundred bytes.
fn doubling(levels: u32) -> Vec<u8> {
    let mut v = b"\x80\x02]r\x00\x00\x00\x00".to_vec();
    for i in 0..levels {
        v.extend_from_slice(b"(j");
        v.extend_from_slice(&i.to_le_bytes());
        v.push(b'j');
        v.extend_from_slice(&i.to_le_bytes());
        v.extend_from_slice(b"l"); // LIST from MARK
        v.push(b'r');
        v.extend_from_slice(&(i + 1).to_le_bytes());
    }
    v.push(b'.');
    v
}

/// A list that contains itself.
fn self_containing() -> Vec<u8> {
    b"\x80\x02]q\x00h\x00a.".to_vec()
}

fn hostile_pickles() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    vec![
        (
            "100k nested lists",
            nested_lists(100_000),
            "nesting deeper than",
        ),
        ("100k nested MARKs", nested_marks(100_000), "MARK depth"),
        (
            "100k nested dicts",
            nested_dicts(100_000),
            "nesting deeper than",
        ),
        (
            "2^100 leaves by memo doubling",
            doubling(100),
            "expands beyond",
        ),
        ("a self-containing list", self_containing(), ""),
    ]
}

#[test]
fn deeply_nested_pickles_end_in_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    let item = tensor_item(&[4], 16);
    for (i, (what, pkl, needle)) in hostile_pickles().into_iter().enumerate() {
        // as a DCP .metadata
        let ck = dcp(&tmp.path().join(format!("m{i}")), &pkl, &item);
        fails_bounded(
            &format!(".metadata: {what}"),
            &["convert", s(&ck), s(&out), "--to", "1"],
            &[".metadata", needle],
        );
        // as the data.pkl of a .pt file
        let pt = tmp.path().join(format!("p{i}.pt"));
        std::fs::write(&pt, archive_with_pickle("archive", pkl.clone())).unwrap();
        fails_bounded(
            &format!(".pt data.pkl: {what}"),
            &["inspect", s(&pt)],
            &[&format!("p{i}.pt"), needle],
        );
        // as a DCP BYTE_IO item
        let dir = tmp.path().join(format!("b{i}"));
        let value = archive_with_pickle("archive", pkl.clone());
        let meta = pickle(&PyValue::object(
            META,
            "Metadata",
            Some(PyValue::str_dict(vec![
                (
                    "state_dict_metadata",
                    PyValue::Dict(vec![(
                        PyValue::Str("step".into()),
                        PyValue::object(META, "BytesStorageMetadata", None),
                    )]),
                ),
                ("planner_data", PyValue::Dict(vec![])),
                (
                    "storage_data",
                    PyValue::Dict(vec![(
                        PyValue::object(
                            META,
                            "MetadataIndex",
                            Some(PyValue::str_dict(vec![
                                ("fqn", PyValue::Str("step".into())),
                                ("index", PyValue::None),
                            ])),
                        ),
                        PyValue::object(
                            FS,
                            "_StorageInfo",
                            Some(PyValue::str_dict(vec![
                                ("relative_path", PyValue::Str("__0_0.distcp".into())),
                                ("offset", PyValue::Int(0)),
                                ("length", PyValue::Int(value.len() as i64)),
                            ])),
                        ),
                    )]),
                ),
            ])),
        ));
        let ck = dcp(&dir, &meta, &value);
        fails_bounded(
            &format!("DCP BYTE_IO item: {what}"),
            &["inspect", s(&ck)],
            &["__0_0.distcp", needle],
        );
        // as a reshard.extras.pickle value in a safetensors header
        let st = tmp.path().join(format!("x{i}.safetensors"));
        let hex: String = pkl.iter().map(|b| format!("{b:02x}")).collect();
        let meta = serde_json::json!({
            "reshard.extras": serde_json::json!({"v": 1}).to_string(),
            "reshard.extras.pickle": serde_json::json!({"v": hex}).to_string(),
        });
        let header = serde_json::json!({
            "__metadata__": meta,
            "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 16]);
        std::fs::write(&st, &bytes).unwrap();
        fails_bounded(
            &format!("reshard.extras.pickle: {what}"),
            &["inspect", s(&st)],
            &[&format!("x{i}.safetensors"), needle],
        );
    }
    assert!(!out.exists());
}

#[test]
fn deeply_nested_json_ends_in_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    // a safetensors header
    let st = tmp.path().join("deep.safetensors");
    let header = format!(r#"{{"w":{{"dtype":"F32","shape":{deep},"data_offsets":[0,4]}}}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 4]);
    std::fs::write(&st, &bytes).unwrap();
    fails_bounded(
        "safetensors header",
        &["inspect", s(&st)],
        &["deep.safetensors"],
    );
    // reshard.extras / reshard.paths JSON inside a header
    for key in ["reshard.extras", "reshard.paths"] {
        let st = tmp.path().join(format!("{key}.safetensors"));
        let header = serde_json::json!({
            "__metadata__": {key: deep},
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 4]);
        std::fs::write(&st, &bytes).unwrap();
        fails_bounded(key, &["inspect", s(&st)], &[key]);
    }
    // an HF index
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::write(
        hf.join("model.safetensors.index.json"),
        format!(r#"{{"metadata":{{}},"weight_map":{deep}}}"#),
    )
    .unwrap();
    fails_bounded(
        "HF index",
        &["inspect", s(&hf)],
        &["model.safetensors.index.json"],
    );
    // a layout file
    let layout = tmp.path().join("layout.json");
    std::fs::write(&layout, format!(r#"{{"mesh":[2],"rules":{deep}}}"#)).unwrap();
    common::write_safetensors(&tmp.path().join("src.safetensors"), &common::model());
    fails_bounded(
        "layout file",
        &[
            "plan",
            s(&tmp.path().join("src.safetensors")),
            "--layout",
            s(&layout),
        ],
        &["layout.json"],
    );
}

/// A target of billions of ranks (`--to`, or a layout file's mesh) is refused before any
/// per-rank state is allocated.
#[test]
fn a_mesh_of_billions_of_ranks_is_refused_quickly() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = common::fixture("fsdp2_w2_f32/checkpoint");
    let out = tmp.path().join("out");
    fails_bounded(
        "--to 4000000000",
        &["convert", s(&ck), s(&out), "--to", "4000000000"],
        &["has more than 1048576 ranks"],
    );
    let layout = tmp.path().join("layout.json");
    std::fs::write(&layout, r#"{"mesh": [65536, 65536], "rules": []}"#).unwrap();
    fails_bounded(
        "mesh [65536, 65536]",
        &["plan", s(&ck), "--layout", s(&layout)],
        &["[65536, 65536]", "has more than 1048576 ranks"],
    );
    assert!(!out.exists());
}
