//! Conversions between frameworks with recipes: a Hugging Face Llama/Qwen2 folder to a
//! megatron-core `torch_dist` checkpoint and back, judged against megatron-core's layouts
//! written out here element by element (fused QKV per query group, `[gate; up]`, padded
//! vocabulary, layers stacked on a leading axis), and the errors of bad recipes and
//! configurations. The models' own logits judge the same conversions in
//! `python/tests/test_frameworks.py`.

use crate::common::{convert, fails, ok, read_all, s, Tensors};
use reshard::formats::Checkpoint;
use std::collections::BTreeMap;
use std::path::Path;

/// A tiny Llama-style configuration (head_dim is not hidden / heads, on purpose).
struct Cfg {
    hidden: usize,
    heads: usize,
    groups: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    layers: usize,
    bias: bool,
}

const CFG: Cfg = Cfg {
    hidden: 8,
    heads: 4,
    groups: 2,
    head_dim: 3,
    ffn: 6,
    vocab: 10,
    layers: 2,
    bias: false,
};

/// f32 values that tell every element apart: tensor `seed`, element i.
fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (seed * 10_000 + i) as f32).collect()
}

fn le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The Hugging Face tensors of `cfg`: name → (shape, values).
fn hf_model(cfg: &Cfg) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let (h, hd) = (cfg.hidden, cfg.head_dim);
    let mut m = BTreeMap::new();
    let mut seed = 0;
    let mut add = |name: String, shape: Vec<usize>| {
        seed += 1;
        let n = shape.iter().product();
        m.insert(name, (shape, values(seed, n)));
    };
    add("model.embed_tokens.weight".into(), vec![cfg.vocab, h]);
    add("lm_head.weight".into(), vec![cfg.vocab, h]);
    add("model.norm.weight".into(), vec![h]);
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h]);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![cfg.heads * hd, h],
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![cfg.groups * hd, h],
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![cfg.groups * hd, h],
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, cfg.heads * hd],
        );
        if cfg.bias {
            add(format!("{p}.self_attn.q_proj.bias"), vec![cfg.heads * hd]);
            add(format!("{p}.self_attn.k_proj.bias"), vec![cfg.groups * hd]);
            add(format!("{p}.self_attn.v_proj.bias"), vec![cfg.groups * hd]);
        }
        add(format!("{p}.mlp.gate_proj.weight"), vec![cfg.ffn, h]);
        add(format!("{p}.mlp.up_proj.weight"), vec![cfg.ffn, h]);
        add(format!("{p}.mlp.down_proj.weight"), vec![h, cfg.ffn]);
    }
    m
}

/// Write `model` as a Hugging Face folder (`model.safetensors` + `config.json`).
fn write_hf(dir: &Path, cfg: &Cfg, model: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) {
    std::fs::create_dir_all(dir).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = model
        .iter()
        .map(|(n, (shape, v))| (n.clone(), shape.clone(), le(v)))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, shape, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                .unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": [if cfg.bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if cfg.bias { "qwen2" } else { "llama" },
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.groups,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.layers,
        "vocab_size": cfg.vocab,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "tie_word_embeddings": false,
        "max_position_embeddings": 64,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// megatron-core's global tensors for the Hugging Face `model`, written element by element:
/// QKV rows per query group (its query heads, then its key head, then its value head), FC1 as
/// `[gate; up]`, the vocabulary padded with zero rows to `padded`, layers stacked in front.
fn megatron_expected(
    cfg: &Cfg,
    model: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    padded: usize,
) -> Tensors {
    let (h, hd) = (cfg.hidden, cfg.head_dim);
    let hpg = cfg.heads / cfg.groups;
    let get = |n: &str| &model[n].1;
    let rows = |v: &Vec<f32>, r: usize, width: usize| v[r * width..(r + 1) * width].to_vec();
    let mut out: Tensors = BTreeMap::new();
    let mut put = |name: &str, shape: Vec<u64>, v: Vec<f32>| {
        out.insert(name.to_string(), ("F32".to_string(), shape, le(&v)));
    };
    let pad = |v: &Vec<f32>| {
        let mut v = v.clone();
        v.resize(padded * h, 0.0);
        v
    };
    put(
        "embedding.word_embeddings.weight",
        vec![padded as u64, h as u64],
        pad(get("model.embed_tokens.weight")),
    );
    put(
        "output_layer.weight",
        vec![padded as u64, h as u64],
        pad(get("lm_head.weight")),
    );
    put(
        "decoder.final_layernorm.weight",
        vec![h as u64],
        get("model.norm.weight").clone(),
    );
    let l = cfg.layers as u64;
    let mut stacked: BTreeMap<&str, (Vec<u64>, Vec<f32>)> = BTreeMap::new();
    let mut push = |key: &'static str, shape: Vec<u64>, v: Vec<f32>| {
        let e = stacked.entry(key).or_insert_with(|| {
            let mut s = vec![l];
            s.extend(shape);
            (s, vec![])
        });
        e.1.extend(v);
    };
    for layer in 0..cfg.layers {
        let p = format!("model.layers.{layer}");
        let fused = |suffix: &str, width: usize| {
            let (q, k, v) = (
                get(&format!("{p}.self_attn.q_proj.{suffix}")),
                get(&format!("{p}.self_attn.k_proj.{suffix}")),
                get(&format!("{p}.self_attn.v_proj.{suffix}")),
            );
            let mut out = vec![];
            for g in 0..cfg.groups {
                for r in g * hpg * hd..(g + 1) * hpg * hd {
                    out.extend(rows(q, r, width));
                }
                for r in g * hd..(g + 1) * hd {
                    out.extend(rows(k, r, width));
                }
                for r in g * hd..(g + 1) * hd {
                    out.extend(rows(v, r, width));
                }
            }
            out
        };
        let qkv_rows = ((cfg.heads + 2 * cfg.groups) * hd) as u64;
        push(
            "decoder.layers.self_attention.linear_qkv.weight",
            vec![qkv_rows, h as u64],
            fused("weight", h),
        );
        if cfg.bias {
            push(
                "decoder.layers.self_attention.linear_qkv.bias",
                vec![qkv_rows],
                fused("bias", 1),
            );
        }
        push(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            vec![h as u64],
            get(&format!("{p}.input_layernorm.weight")).clone(),
        );
        push(
            "decoder.layers.self_attention.linear_proj.weight",
            vec![h as u64, (cfg.heads * hd) as u64],
            get(&format!("{p}.self_attn.o_proj.weight")).clone(),
        );
        push(
            "decoder.layers.mlp.linear_fc1.layer_norm_weight",
            vec![h as u64],
            get(&format!("{p}.post_attention_layernorm.weight")).clone(),
        );
        let mut fc1 = get(&format!("{p}.mlp.gate_proj.weight")).clone();
        fc1.extend(get(&format!("{p}.mlp.up_proj.weight")));
        push(
            "decoder.layers.mlp.linear_fc1.weight",
            vec![(2 * cfg.ffn) as u64, h as u64],
            fc1,
        );
        push(
            "decoder.layers.mlp.linear_fc2.weight",
            vec![h as u64, cfg.ffn as u64],
            get(&format!("{p}.mlp.down_proj.weight")).clone(),
        );
    }
    for (k, (shape, v)) in stacked {
        put(k, shape, v);
    }
    out
}

fn as_tensors(model: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) -> Tensors {
    model
        .iter()
        .map(|(n, (shape, v))| {
            let shape = shape.iter().map(|&d| d as u64).collect();
            (n.clone(), ("F32".to_string(), shape, le(v)))
        })
        .collect()
}

/// HF → megatron (TP 2's padding) → HF, for a model with and without q/k/v biases.
fn round_trip(cfg: &Cfg, recipe: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let (hf, mc, back) = (
        tmp.path().join("hf"),
        tmp.path().join("mc"),
        tmp.path().join("back"),
    );
    let model = hf_model(cfg);
    write_hf(&hf, cfg, &model);
    let said = convert(&hf, &mc, &["--format", "megatron", "--param", "tp=2"]);
    assert!(
        said.contains(&format!(
            "recipe {recipe} (config.json: model_type={recipe}): hf -> megatron"
        )),
        "{said}"
    );
    let ck = Checkpoint::open(&mc).unwrap();
    let got = read_all(&ck);
    let want = megatron_expected(cfg, &model, 256);
    crate::common::assert_same(recipe, "megatron output", &got, &want);
    // common.pt carries Megatron-LM's arguments, so the way back needs no parameter
    let args = reshard::recipe::source_config(&ck, "megatron")
        .unwrap()
        .expect("args in common.pt");
    assert_eq!(args["padded_vocab_size"], 256);
    assert_eq!(args["num_query_groups"], cfg.groups);
    assert_eq!(args["kv_channels"], cfg.head_dim);
    assert_eq!(args["add_qkv_bias"], cfg.bias);
    assert_eq!(args["rotary_base"], 500000.0);
    let said = convert(&mc, &back, &["--format", "hf"]);
    assert!(
        said.contains(&format!("recipe {recipe} (common.pt args: ")),
        "{said}"
    );
    let ck = Checkpoint::open(&back).unwrap();
    crate::common::assert_same(recipe, "round trip", &read_all(&ck), &as_tensors(&model));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(back.join("config.json")).unwrap()).unwrap();
    for (k, v) in [
        ("model_type", serde_json::json!(recipe)),
        ("hidden_size", cfg.hidden.into()),
        ("num_key_value_heads", cfg.groups.into()),
        ("head_dim", cfg.head_dim.into()),
        ("vocab_size", cfg.vocab.into()),
        ("rms_norm_eps", 1e-6.into()),
        ("rope_theta", 500000.0.into()),
        ("tie_word_embeddings", false.into()),
    ] {
        assert_eq!(config[k], v, "{recipe}: config.json {k}");
    }
}

#[test]
fn llama_hf_to_megatron_fuses_as_megatron_core_and_comes_back_byte_exact() {
    round_trip(&CFG, "llama");
}

#[test]
fn qwen2_biases_fuse_like_their_weights() {
    round_trip(&Cfg { bias: true, ..CFG }, "qwen2");
}

#[test]
fn plan_shows_the_recipe_its_parameters_and_each_view() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    write_hf(&hf, &CFG, &hf_model(&CFG));
    let out = ok(&[
        "plan",
        s(&hf),
        "--format",
        "megatron",
        "--param",
        "padded_vocab=16",
    ]);
    assert!(out.contains("groups=2 (hf: num_key_value_heads)"), "{out}");
    assert!(out.contains("padded_vocab=16 (given)"), "{out}");
    assert!(
        out.contains("= pad(model.embed_tokens.weight, 0, 0, 6, 0)"),
        "{out}"
    );
    assert!(
        out.contains("split(model.layers.0.self_attn.k_proj.weight, 0, [2, 1, 3])"),
        "{out}"
    );
    assert!(out.contains("fill op(s)"), "{out}");
    let json = ok(&["plan", s(&hf), "--format", "megatron", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["recipe"]["name"], "llama");
    assert_eq!(v["recipe"]["params"]["padded_vocab"], 128);
    let qkv = v["plan"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "decoder.layers.self_attention.linear_qkv.weight")
        .unwrap();
    assert_eq!(qkv["view"]["op"], "concat");
    // names kept: --recipe none
    let plain = ok(&["plan", s(&hf), "--format", "megatron", "--recipe", "none"]);
    assert!(!plain.contains("recipe "), "{plain}");
    assert!(
        plain.contains("model.layers.0.self_attn.q_proj.weight"),
        "{plain}"
    );
}

#[test]
fn inspect_names_the_recipe_that_applies() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    write_hf(&hf, &CFG, &hf_model(&CFG));
    let out = ok(&["inspect", s(&hf)]);
    assert!(
        out.contains("recipe llama (config.json: model_type=llama) converts it to megatron (--format megatron)"),
        "{out}"
    );
}

/// A user's recipe file extending the built-in, and one with mistakes.
#[test]
fn bad_recipes_and_configurations_are_one_line_errors_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let model = hf_model(&CFG);
    write_hf(&hf, &CFG, &model);
    let dst = tmp.path().join("out");
    let d = s(&dst);
    let case = |args: &[&str], needle: &str| {
        let mut all = vec!["convert", s(&hf), d, "--format", "megatron"];
        all.extend_from_slice(args);
        fails(&all, needle);
        assert!(!dst.exists(), "{args:?} left an output");
    };
    // a configuration that contradicts the shapes: 3 heads × 3 channels ≠ 12 rows of q_proj
    case(
        &["--param", "heads=3", "--param", "groups=3"],
        "tensor `decoder.layers.0.self_attention.linear_qkv.weight`: recipe llama:",
    );
    case(&["--param", "head_dim=4"], "recipe llama");
    case(
        &["--param", "nope=1"],
        "recipe llama has no parameter `nope`",
    );
    case(
        &["--recipe", "gpt-17"],
        "no recipe `gpt-17`: not a built-in (llama, mistral, qwen2, mixtral, qwen2_moe)",
    );
    // a target defined twice
    let twice = tmp.path().join("twice.json");
    std::fs::write(
        &twice,
        r#"{"recipe": "twice", "maps": [{"from": "hf", "to": "megatron", "ignore": ["**"], "tensors": [
            {"name": "a", "view": {"op": "source", "name": "model.norm.weight"}},
            {"name": "a", "view": {"op": "source", "name": "model.norm.weight"}}]}]}"#,
    )
    .unwrap();
    case(
        &["--recipe", s(&twice)],
        "tensor `a`: recipe twice defines this target tensor twice",
    );
    // a source no rule reads
    let partial = tmp.path().join("partial.json");
    std::fs::write(
        &partial,
        r#"{"recipe": "partial", "maps": [{"from": "hf", "to": "megatron", "tensors": [
            {"name": "final_norm", "view": {"op": "source", "name": "model.norm.weight"}}]}]}"#,
    )
    .unwrap();
    case(
        &["--recipe", s(&partial)],
        "tensor `lm_head.weight`: recipe partial (hf → megatron) leaves this source tensor uncovered (and 19 more)",
    );
    // a source that is not there
    let absent = tmp.path().join("absent.json");
    std::fs::write(
        &absent,
        r#"{"recipe": "absent", "maps": [{"from": "hf", "to": "megatron", "ignore": ["**"], "tensors": [
            {"name": "x", "view": {"op": "source", "name": "model.layers.7.mlp.up_proj.weight"}}]}]}"#,
    )
    .unwrap();
    case(
        &["--recipe", s(&absent)],
        "recipe absent reads source tensor model.layers.7.mlp.up_proj.weight, which the checkpoint does not have",
    );
    // not JSON of a recipe
    let junk = tmp.path().join("junk.json");
    std::fs::write(&junk, r#"{"recipe": "junk", "tensors": []}"#).unwrap();
    case(
        &["--recipe", s(&junk)],
        "junk.json: bad recipe: unknown field `tensors`",
    );
    // a recipe where the frameworks are the same
    let mc = tmp.path().join("mc");
    convert(&hf, &mc, &["--format", "megatron"]);
    fails(
        &[
            "convert",
            s(&mc),
            d,
            "--format",
            "megatron",
            "--recipe",
            "llama",
        ],
        "recipe llama: the source and the output are both megatron checkpoints",
    );
    assert!(!dst.exists());
}

/// A user's recipe that extends a built-in: its parameters replace the base's.
#[test]
fn a_recipe_file_may_extend_a_builtin() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    write_hf(&hf, &CFG, &hf_model(&CFG));
    let mine = tmp.path().join("mine.json");
    std::fs::write(
        &mine,
        r#"{"recipe": "mine", "extends": "llama", "params": {"divisible_by": {"default": 4}}}"#,
    )
    .unwrap();
    let mc = tmp.path().join("mc");
    let said = convert(&hf, &mc, &["--format", "megatron", "--recipe", s(&mine)]);
    assert!(
        said.contains("recipe mine (--recipe): hf -> megatron"),
        "{said}"
    );
    let ck = Checkpoint::open(&mc).unwrap();
    let emb = ck.tensor("embedding.word_embeddings.weight").unwrap();
    assert_eq!(emb.shape, vec![12, 8]); // 10 rounded up to a multiple of 4
}

/// The Qwen2-MoE fixture (`tests/fixtures/frameworks/qwen2moe_tp2_ep2`: a real megatron-core
/// model at TP 2 × EP 2 with q/k/v biases, 4 routed experts and a gated shared expert, saved
/// by `scripts/gen_frameworks.py`): its `torch_dist` and legacy saves convert to mbridge's
/// export byte for byte, with the configuration transformers' Qwen2MoeForCausalLM reads, and
/// mbridge's export converts to megatron-core's own tensors (the vocabulary's padding rows
/// zeros) and back byte-exact.
#[test]
fn qwen2_moe_fixture_converts_to_mbridges_export_and_back_byte_exact() {
    let case = crate::common::fixture("frameworks/qwen2moe_tp2_ep2");
    let mbridge = case.join("hf_mbridge");
    let want = read_all(&Checkpoint::open(&mbridge).unwrap());
    assert!(want.contains_key("model.layers.1.mlp.shared_expert_gate.weight"));
    assert!(want.contains_key("model.layers.1.mlp.experts.3.up_proj.weight"));
    let tmp = tempfile::tempdir().unwrap();
    for form in ["torch_dist", "legacy"] {
        let out = tmp.path().join(form);
        let said = convert(&case.join(form), &out, &["--format", "hf"]);
        assert!(
            said.contains("recipe qwen2_moe (common.pt args: num_experts and moe_shared_expert_intermediate_size are set"),
            "{said}"
        );
        let got = read_all(&Checkpoint::open(&out).unwrap());
        crate::common::assert_same("qwen2moe_tp2_ep2", form, &got, &want);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        for (k, v) in [
            ("model_type", serde_json::json!("qwen2_moe")),
            ("architectures", serde_json::json!(["Qwen2MoeForCausalLM"])),
            ("intermediate_size", 40.into()),
            ("moe_intermediate_size", 24.into()),
            ("shared_expert_intermediate_size", 32.into()),
            ("num_experts", 4.into()),
            ("num_experts_per_tok", 2.into()),
            ("norm_topk_prob", false.into()),
            ("decoder_sparse_step", 1.into()),
            ("mlp_only_layers", serde_json::json!([])),
            ("qkv_bias", true.into()),
            ("vocab_size", 96.into()),
        ] {
            assert_eq!(config[k], v, "{form}: config.json {k}");
        }
    }
    // Hugging Face -> megatron (padded for TP 2, as the fixture) -> Hugging Face
    let (mc, back) = (tmp.path().join("mc"), tmp.path().join("back"));
    let said = convert(&mbridge, &mc, &["--format", "megatron", "--param", "tp=2"]);
    assert!(
        said.contains("recipe qwen2_moe (config.json: model_type=qwen2_moe): hf -> megatron"),
        "{said}"
    );
    let ck = Checkpoint::open(&mc).unwrap();
    let mut got = read_all(&ck);
    let mut saved = read_all(&Checkpoint::open(case.join("torch_dist")).unwrap());
    for name in ["embedding.word_embeddings.weight", "output_layer.weight"] {
        // the first 96 rows are the vocabulary; megatron-core's padding rows were random
        let (g, w) = (
            &mut got.get_mut(name).unwrap().2,
            &mut saved.get_mut(name).unwrap().2,
        );
        let rows = 96 * 16 * 4;
        assert!(
            g[rows..].iter().all(|&b| b == 0),
            "{name}: padding not zeros"
        );
        g.truncate(rows);
        w.truncate(rows);
    }
    crate::common::assert_same("qwen2moe_tp2_ep2", "hf -> megatron", &got, &saved);
    let args = reshard::recipe::source_config(&ck, "megatron")
        .unwrap()
        .expect("args in common.pt");
    assert_eq!(args["num_experts"], 4);
    assert_eq!(args["moe_ffn_hidden_size"], 24);
    assert_eq!(args["ffn_hidden_size"], 40);
    assert_eq!(args["moe_shared_expert_intermediate_size"], 32);
    assert_eq!(args["moe_shared_expert_gate"], true);
    assert_eq!(args["moe_router_pre_softmax"], true);
    assert_eq!(args["add_qkv_bias"], true);
    convert(&mc, &back, &["--format", "hf"]);
    crate::common::assert_same(
        "qwen2moe_tp2_ep2",
        "round trip",
        &read_all(&Checkpoint::open(&back).unwrap()),
        &want,
    );
}
