//! Tied weights (issue #4, point 4) on a real torch-written checkpoint: an FSDP2 model whose
//! `lm_head.weight` is its `embed.weight` (one Parameter, two names), which DCP saved as two
//! items. A `.pt` output stores it once, as `torch.save` of the tied model does; safetensors
//! keeps both copies and `inspect` says so.

use crate::common::{convert, fixture, ok, python, read_safetensors, s, torch_or_skip};
use std::path::{Path, PathBuf};

fn ckpt() -> PathBuf {
    fixture("fsdp2_w2_tied/checkpoint")
}

#[test]
fn inspect_names_tied_tensors() {
    let text = ok(&["inspect", s(&ckpt())]);
    assert!(
        text.contains("tied: model.embed.weight = model.lm_head.weight (same dtype, shape and bytes); a .pt output stores it once"),
        "{text}"
    );
    assert_eq!(text.matches("tied:").count(), 1, "{text}");
    // untied fixtures of the same model report none (equal zeros or ones are not ties)
    for case in ["fsdp2_w2_f32", "fsdp2_w4_f32", "dtensor2d_w4"] {
        let t = ok(&["inspect", s(&fixture(case).join("checkpoint"))]);
        assert!(!t.contains("tied:"), "{case}: {t}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", s(&ckpt()), "--json"])).unwrap();
    assert_eq!(
        json["tied"],
        serde_json::json!([["model.embed.weight", "model.lm_head.weight"]])
    );

    // safetensors holds both copies, and inspect says why
    let d = tempfile::tempdir().unwrap();
    let st = d.path().join("m.safetensors");
    convert(&ckpt(), &st, &["--to", "1", "-q"]);
    let t = read_safetensors(&st);
    assert_eq!(t["model.embed.weight"].data, t["model.lm_head.weight"].data);
    let text = ok(&["inspect", s(&st)]);
    assert!(
        text.contains("tied: model.embed.weight = model.lm_head.weight (same dtype, shape and bytes); safetensors cannot alias, so each name keeps a copy"),
        "{text}"
    );
}

#[test]
fn pt_stores_a_tied_group_once() {
    let d = tempfile::tempdir().unwrap();
    let once = d.path().join("once.pt");
    let twice = d.path().join("twice.pt");
    let msg = convert(&ckpt(), &once, &["--to", "1"]);
    assert!(
        msg.contains("tied: model.embed.weight = model.lm_head.weight (stored once)"),
        "{msg}"
    );
    let msg = convert(&ckpt(), &twice, &["--to", "1", "--untie"]);
    assert!(!msg.contains("tied:"), "{msg}");
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    // one 480-byte record (plus its zip headers and alignment) fewer
    assert!(
        size(&twice) >= size(&once) + 480,
        "{} vs {}",
        size(&twice),
        size(&once)
    );
    let Some(py) = torch_or_skip() else {
        return;
    };
    let code = format!(
        r#"
import torch
from safetensors.torch import load_file
oracle = load_file({oracle:?})
for path, shared in (({once:?}, True), ({twice:?}, False)):
    sd = torch.load(path, weights_only=True)
    e, h = sd["model"]["embed.weight"], sd["model"]["lm_head.weight"]
    assert torch.equal(e, oracle["model.embed.weight"]) and torch.equal(h, oracle["model.lm_head.weight"])
    same = e.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    assert same == shared, (path, same)
    # everything else is untouched
    n = 0
    def walk(p, v):
        global n
        if isinstance(v, dict):
            for k, x in v.items(): walk(p + [str(k)], x)
        elif isinstance(v, list):
            for i, x in enumerate(v): walk(p + [str(i)], x)
        elif isinstance(v, torch.Tensor):
            k = ".".join(p)
            assert torch.equal(v.contiguous().view(-1).view(torch.uint8), oracle[k].contiguous().view(-1).view(torch.uint8)), k
            n += 1
    walk([], sd)
    assert n == len(oracle), (n, len(oracle))
print("ok")
"#,
        oracle = s(&fixture("fsdp2_w2_tied/oracle/full.safetensors")),
        once = s(&once),
        twice = s(&twice),
    );
    python(&py, &code);
}
