//! Unit tests of the reader: every opcode family, the limits and budgets, and real DCP and
//! `torch.save` pickles from `tests/data/pickle`.

use super::*;
use crate::torch::pickle::{dcp_metadata_globals, torch_save_globals};

fn all() -> Globals {
    let mut g = torch_save_globals();
    g.extend(&dcp_metadata_globals());
    g.allow("m", "C");
    g
}

fn p(bytes: &[u8]) -> Result<Value, PickleError> {
    parse(bytes, &all())
}

fn ok(bytes: &[u8]) -> Value {
    match p(bytes) {
        Ok(v) => v,
        Err(e) => panic!("parse failed: {e}"),
    }
}

fn err(bytes: &[u8]) -> String {
    match p(bytes) {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn s(x: &str) -> Value {
    Value::Str(x.to_owned())
}

// --- scalars -------------------------------------------------------------------------

#[test]
fn scalars_binary() {
    assert_eq!(ok(b"\x80\x02N."), Value::None);
    assert_eq!(ok(b"\x80\x02\x88."), Value::Bool(true));
    assert_eq!(ok(b"\x80\x02\x89."), Value::Bool(false));
    assert_eq!(ok(b"K\xff."), Value::Int(255));
    assert_eq!(ok(b"M\x01\x02."), Value::Int(0x0201));
    assert_eq!(ok(b"J\xff\xff\xff\xff."), Value::Int(-1));
    assert_eq!(ok(b"J\x00\x00\x00\x80."), Value::Int(i64::from(i32::MIN)));
    // BINFLOAT is big-endian: 0.005 as in optimizer lr items.
    let mut b = vec![b'G'];
    b.extend_from_slice(&0.005f64.to_be_bytes());
    b.push(b'.');
    assert_eq!(ok(&b), Value::Float(0.005));
}

#[test]
fn long1_long4() {
    assert_eq!(ok(b"\x8a\x00."), Value::Int(0));
    assert_eq!(ok(b"\x8a\x01\xff."), Value::Int(-1));
    assert_eq!(ok(b"\x8a\x02\xff\x00."), Value::Int(255));
    // 2^31 (an offset in a >2 GiB file)
    assert_eq!(ok(b"\x8a\x05\x00\x00\x00\x80\x00."), Value::Int(1 << 31));
    // i64::MIN and i64::MAX with redundant sign bytes
    assert_eq!(
        ok(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\xff."),
        Value::Int(i64::MIN)
    );
    assert_eq!(
        ok(b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\x00."),
        Value::Int(i64::MAX)
    );
    // 2^64 does not fit i64
    assert_eq!(
        ok(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01."),
        Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 1])
    );
    assert_eq!(ok(b"\x8b\x02\x00\x00\x00\x00\x01."), Value::Int(256));
    assert!(err(b"\x8b\xff\xff\xff\xff.").contains("negative LONG4 length"));
}

#[test]
fn text_ints_and_floats() {
    assert_eq!(ok(b"I42\n."), Value::Int(42));
    assert_eq!(ok(b"I-7\n."), Value::Int(-7));
    assert_eq!(ok(b"I01\n."), Value::Bool(true));
    assert_eq!(ok(b"I00\n."), Value::Bool(false));
    assert_eq!(ok(b"L5L\n."), Value::Int(5));
    // 2^70 as written by protocol 0
    assert_eq!(
        ok(b"L1180591620717411303424L\n."),
        Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 0x40])
    );
    assert_eq!(
        ok(b"L-9223372036854775809\n."),
        Value::BigInt(vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff])
    );
    assert_eq!(ok(b"F1.5\n."), Value::Float(1.5));
    assert!(err(b"Iabc\n.").contains("invalid INT literal at byte 0"));
    let mut long = b"L".to_vec();
    long.extend(std::iter::repeat_n(b'9', MAX_TEXT_INT_DIGITS + 1));
    long.extend_from_slice(b"\n.");
    assert!(err(&long).contains("longer than"));
}

#[test]
fn strings_and_bytes() {
    assert_eq!(ok(b"X\x03\x00\x00\x00abc."), s("abc"));
    assert_eq!(ok(b"\x8c\x02\xc3\xa9."), s("é"));
    assert_eq!(ok(b"\x8d\x01\x00\x00\x00\x00\x00\x00\x00z."), s("z"));
    assert_eq!(ok(b"Vcaf\xe9\\u20ac\n."), s("café€"));
    assert_eq!(ok(b"U\x02hi."), Value::Bytes(b"hi".to_vec()));
    assert_eq!(ok(b"T\x01\x00\x00\x00x."), Value::Bytes(b"x".to_vec()));
    assert_eq!(ok(b"C\x01\x00."), Value::Bytes(vec![0]));
    assert_eq!(ok(b"B\x02\x00\x00\x00ab."), Value::Bytes(b"ab".to_vec()));
    assert_eq!(
        ok(b"\x8e\x01\x00\x00\x00\x00\x00\x00\x00q."),
        Value::Bytes(b"q".to_vec())
    );
    assert_eq!(
        ok(b"\x96\x01\x00\x00\x00\x00\x00\x00\x00q."),
        Value::Bytes(b"q".to_vec())
    );
    assert!(err(b"\x8c\x01\xff.").contains("invalid utf-8 in SHORT_BINUNICODE at byte 0"));
    assert!(err(b"T\xff\xff\xff\xff.").contains("negative BINSTRING length"));
}

// --- containers ----------------------------------------------------------------------

#[test]
fn tuples() {
    assert_eq!(ok(b").").as_list().map(<[Value]>::len), Some(0));
    assert_eq!(ok(b"K\x01\x85."), Value::Tuple(vec![Value::Int(1)]));
    assert_eq!(
        ok(b"K\x01K\x02\x86."),
        Value::Tuple(vec![Value::Int(1), Value::Int(2)])
    );
    assert_eq!(
        ok(b"K\x01K\x02K\x03\x87."),
        Value::Tuple(vec![Value::Int(1), Value::Int(2), Value::Int(3)])
    );
    assert_eq!(
        ok(b"(K\x01K\x02K\x03K\x04t."),
        Value::Tuple((1..=4).map(Value::Int).collect())
    );
}

#[test]
fn lists() {
    assert_eq!(ok(b"]."), Value::List(vec![]));
    assert_eq!(ok(b"]K\x01a."), Value::List(vec![Value::Int(1)]));
    assert_eq!(
        ok(b"](K\x01K\x02e."),
        Value::List(vec![Value::Int(1), Value::Int(2)])
    );
    assert_eq!(ok(b"(K\x01l."), Value::List(vec![Value::Int(1)]));
    assert!(err(b")K\x01a.").contains("APPEND to a tuple at byte 3"));
}

#[test]
fn dicts() {
    assert_eq!(ok(b"}."), Value::Dict(vec![]));
    let d = ok(b"}X\x01\x00\x00\x00aK\x01s.");
    assert_eq!(d.get("a"), Some(&Value::Int(1)));
    let d = ok(b"}(\x8c\x01aK\x01\x8c\x01bK\x02u.");
    assert_eq!(d.as_dict().map(<[(Value, Value)]>::len), Some(2));
    assert_eq!(d.get("b"), Some(&Value::Int(2)));
    let d = ok(b"(\x8c\x01aK\x01d.");
    assert_eq!(d.get("a"), Some(&Value::Int(1)));
    assert!(err(b"}(K\x01u.").contains("odd number of items for SETITEMS"));
    assert!(err(b"]K\x01K\x02s.").contains("SETITEM on a list"));
    // A repeated key keeps its first position and its last value, as in Python.
    let d = ok(b"}(\x8c\x01aK\x01\x8c\x01bK\x02\x8c\x01aK\x03u.");
    assert_eq!(
        d,
        Value::Dict(vec![(s("a"), Value::Int(3)), (s("b"), Value::Int(2))])
    );
}

#[test]
fn object_keys_in_dicts() {
    // {C(): 1}: an object as a dict key, as MetadataIndex in storage_data.
    let d = ok(b"\x80\x04}\x8c\x01m\x8c\x01C\x93)\x81}\x8c\x03fqn\x8c\x01xsbK\x01s.");
    let pairs = d.as_dict().expect("dict");
    assert_eq!(pairs.len(), 1);
    let (k, v) = &pairs[0];
    assert!(k.is_object("m", "C"));
    assert_eq!(k.get("fqn"), Some(&s("x")));
    assert_eq!(v, &Value::Int(1));
}

#[test]
fn sets() {
    assert_eq!(ok(b"\x8f."), Value::Set(vec![]));
    assert_eq!(
        ok(b"\x8f(K\x01K\x02\x90."),
        Value::Set(vec![Value::Int(1), Value::Int(2)])
    );
    assert_eq!(ok(b"(K\x03\x91."), Value::Set(vec![Value::Int(3)]));
    // protocol 2: __builtin__.set([1, 2]) is mapped to builtins.set
    let v = ok(b"\x80\x02c__builtin__\nset\n](K\x01K\x02e\x85R.");
    assert_eq!(v, Value::Set(vec![Value::Int(1), Value::Int(2)]));
    let v = ok(b"\x80\x02c__builtin__\nfrozenset\n]K\x03a\x85R.");
    assert_eq!(v, Value::Set(vec![Value::Int(3)]));
}

// --- stack ops -----------------------------------------------------------------------

#[test]
fn stack_manipulation() {
    assert_eq!(ok(b"K\x01K\x020."), Value::Int(1));
    assert_eq!(ok(b"K\x01(K\x02K\x031."), Value::Int(1));
    // POP with nothing above the mark pops the mark, as Python does
    assert_eq!(ok(b"K\x01(0."), Value::Int(1));
    assert_eq!(
        ok(b"]2K\x01a\x86."),
        Value::Tuple(vec![
            Value::List(vec![Value::Int(1)]),
            Value::List(vec![Value::Int(1)])
        ])
    );
    // Items below a MARK are not reachable
    assert!(err(b"K\x01(\x85.").contains("stack underflow at byte 3 (TUPLE1)"));
    assert!(err(b"K\x01t.").contains("TUPLE without a MARK at byte 2"));
    assert!(err(b"(.").contains("stack underflow at byte 1 (STOP)"));
    assert!(err(b"0.").contains("POP without a MARK at byte 0"));
}

#[test]
fn frames_and_protocols() {
    assert_eq!(
        ok(b"\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00N."),
        Value::None
    );
    assert!(err(b"\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00N.")
        .starts_with("truncated at byte 2 (FRAME needs"));
    assert!(err(b"\x80\x06N.").contains("unsupported pickle protocol 6"));
    assert_eq!(ok(b"\x80\x05N."), Value::None);
}

#[test]
fn trailing_bytes_and_length() {
    let (v, n) = parse_with_len(b"K\x07.garbage", &all()).expect("parse");
    assert_eq!((v, n), (Value::Int(7), 3));
}

// --- memo ----------------------------------------------------------------------------

#[test]
fn memo_variants() {
    assert_eq!(
        ok(b"\x8c\x01a\x94h\x00\x86."),
        Value::Tuple(vec![s("a"), s("a")])
    );
    assert_eq!(
        ok(b"K\x05q\x07h\x07\x86."),
        Value::Tuple(vec![Value::Int(5), Value::Int(5)])
    );
    assert_eq!(
        ok(b"K\x05r\x00\x01\x00\x00j\x00\x01\x00\x00\x86."),
        Value::Tuple(vec![Value::Int(5), Value::Int(5)])
    );
    assert_eq!(
        ok(b"K\x05p3\ng3\n\x86."),
        Value::Tuple(vec![Value::Int(5), Value::Int(5)])
    );
    assert!(err(b"h\x09.").contains("memo key 9 not found at byte 0"));
    assert!(err(b"q\x00.").contains("stack underflow at byte 0 (BINPUT)"));
    // MEMOIZE uses len(memo) as its key, even after explicit BINPUTs.
    assert_eq!(
        ok(b"K\x01q\x05K\x02\x94h\x01h\x05\x86."),
        Value::Tuple(vec![Value::Int(2), Value::Int(1)])
    );
}

#[test]
fn memo_sees_later_mutations() {
    // l = []; memo[0] = l; l.append(1); t = (l, memo[0]); memo[0].append(2)
    // Both tuple members are the same list: [1, 2].
    let v = ok(b"]q\x00K\x01ah\x00h\x00\x86h\x00K\x02a0.");
    let one_two = Value::List(vec![Value::Int(1), Value::Int(2)]);
    assert_eq!(v, Value::Tuple(vec![one_two.clone(), one_two]));
    // A dict filled after it was memoised and referenced.
    // d = {}; memo[0] = d; l = [d]; memo[0]['k'] = 1; result l == [{'k': 1}]
    let v = ok(b"}\x94]h\x00ah\x00\x8c\x01kK\x01s0.");
    assert_eq!(
        v,
        Value::List(vec![Value::Dict(vec![(s("k"), Value::Int(1))])])
    );
}

#[test]
fn memo_reuse_across_classes() {
    // The same memoised 'offset' key string used by two different classes' state dicts,
    // as in torch 2.15 .metadata (MetadataIndex and _StorageInfo share it).
    let v = ok(
        b"\x80\x04\x8c\x01m\x94\x8c\x01C\x94\x93\x94)\x81}(\x8c\x06offset\x94K\x01ub\
h\x02)\x81}(h\x03K\x02ub\x86.",
    );
    let items = v.as_list().expect("tuple");
    assert_eq!(items[0].get("offset"), Some(&Value::Int(1)));
    assert_eq!(items[1].get("offset"), Some(&Value::Int(2)));
}

// --- globals and objects -------------------------------------------------------------

#[test]
fn globals_allow_list() {
    assert_eq!(
        ok(b"ctorch\nfloat32\n."),
        Value::Global {
            module: "torch".into(),
            name: "float32".into()
        }
    );
    assert!(ok(b"\x8c\x05torch\x8c\x04bool\x93.").is_global("torch", "bool"));
    assert_eq!(
        err(b"\x80\x02cos\nsystem\n."),
        "unknown global `os.system` at byte 2"
    );
    assert_eq!(
        err(b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93."),
        "unknown global `builtins.eval` at byte 18"
    );
    // __builtin__ is only mapped for protocol < 3
    assert_eq!(
        err(b"\x80\x03c__builtin__\nset\n."),
        "unknown global `__builtin__.set` at byte 2"
    );
    assert!(err(b"K\x01K\x02\x93.").contains("STACK_GLOBAL needs two str"));
    // Hostile names are shortened and escaped in messages, kept whole in the fields.
    let mut b = b"\x8c\x02a\n\x8d".to_vec();
    b.extend_from_slice(&1000u64.to_le_bytes());
    b.extend(std::iter::repeat_n(b'x', 1000));
    b.extend_from_slice(b"\x93.");
    match p(&b) {
        Err(PickleError::UnknownGlobal {
            module,
            name,
            offset,
        }) => {
            assert_eq!((module.as_str(), name.len(), offset), ("a\n", 1000, 1013));
        }
        other => panic!("{other:?}"),
    }
    let msg = err(&b);
    assert!(msg.starts_with("unknown global `a\\n.xxxx"), "{msg}");
    assert!(msg.ends_with("x…` at byte 1013"), "{msg}");
    let g = Globals::new();
    assert!(parse(b"ctorch\nfloat32\n.", &g).is_err());
    let mut g = Globals::new();
    g.allow_module("torch");
    assert!(parse(b"ctorch\nanything\n.", &g).is_ok());
    assert!(parse(b"ctorch.x\nanything\n.", &g).is_err());
}

#[test]
fn reduce_newobj_build() {
    // torch.Size((3, 12))
    let v = ok(b"\x80\x02ctorch\nSize\nK\x03K\x0c\x86\x85R.");
    assert!(v.is_object("torch", "Size"));
    assert_eq!(v.as_int_tuple(), Some(vec![3, 12]));
    // torch.Size(())
    assert_eq!(ok(b"ctorch\nSize\n)\x85R.").as_int_tuple(), Some(vec![]));
    // dataclass: cls() NEWOBJ, BUILD with a dict
    let v = ok(b"\x80\x02cm\nC\n)\x81}(\x8c\x01aK\x01ub.");
    assert!(v.is_object("m", "C"));
    assert_eq!(v.args(), Some(&[][..]));
    assert_eq!(v.get("a"), Some(&Value::Int(1)));
    // BUILD with a tuple state (TensorProperties __setstate__)
    let v = ok(b"cm\nC\n)\x81K\x01K\x02\x86b.");
    assert_eq!(
        v.state(),
        Some(&Value::Tuple(vec![Value::Int(1), Value::Int(2)]))
    );
    // Two dict BUILDs merge; the later value wins.
    let v = ok(b"cm\nC\n)\x81}(\x8c\x01aK\x01\x8c\x01bK\x02ub}(\x8c\x01aK\x09ub.");
    assert_eq!(v.get("a"), Some(&Value::Int(9)));
    assert_eq!(v.get("b"), Some(&Value::Int(2)));
    // BUILD None is a no-op
    assert_eq!(ok(b"cm\nC\n)\x81Nb.").state(), None);
    // NEWOBJ_EX with empty kwargs
    assert!(ok(b"cm\nC\n)}\x92.").is_object("m", "C"));
    assert!(err(b"cm\nC\n)}\x8c\x01kK\x01s\x92.").contains("keyword arguments"));
    // INST and OBJ (protocol 0/1)
    let v = ok(b"(K\x01im\nC\n.");
    assert!(v.is_object("m", "C"));
    assert_eq!(v.args(), Some(&[Value::Int(1)][..]));
    let v = ok(b"(cm\nC\nK\x02o.");
    assert_eq!(v.args(), Some(&[Value::Int(2)][..]));
    // Errors
    assert!(err(b"K\x01)R.").contains("REDUCE on a int"));
    assert!(err(b"cm\nC\nK\x01R.").contains("REDUCE arguments must be a tuple, got a int"));
    assert!(err(b"K\x01N b.").contains("unknown opcode 0x20"));
    assert!(err(b"]}b.").contains("BUILD on a list"));
    assert!(err(b"}K\x01b.").contains("BUILD of a dict with a int state"));
}

#[test]
fn builtin_specials() {
    // OrderedDict() then SETITEM, as in torch.save backward_hooks and state dicts
    let v = ok(b"\x80\x02ccollections\nOrderedDict\n)RX\x01\x00\x00\x00aK\x01s.");
    assert_eq!(v, Value::Dict(vec![(s("a"), Value::Int(1))]));
    // OrderedDict([('a', 1)])
    let v = ok(b"ccollections\nOrderedDict\n]\x8c\x01aK\x01\x86a\x85R.");
    assert_eq!(v.get("a"), Some(&Value::Int(1)));
    // OrderedDict BUILD with a dict state merges
    let v = ok(b"ccollections\nOrderedDict\n)R}\x8c\x01bK\x02sb.");
    assert_eq!(v.get("b"), Some(&Value::Int(2)));
    // bytes in protocol 2: _codecs.encode('ab\xff', 'latin1')
    let v =
        ok(b"\x80\x02c_codecs\nencode\nX\x04\x00\x00\x00ab\xc3\xbfX\x06\x00\x00\x00latin1\x86R.");
    assert_eq!(v, Value::Bytes(vec![b'a', b'b', 0xff]));
    // bytearray(_codecs.encode('xy', 'latin1'))
    let v = ok(
        b"\x80\x02c__builtin__\nbytearray\nc_codecs\nencode\n\x8c\x02xy\x8c\x06latin1\x86R\x85R.",
    );
    assert_eq!(v, Value::Bytes(b"xy".to_vec()));
    // protocol 4 bytearray(b'xy')
    let v = ok(b"\x80\x04\x8c\x08builtins\x8c\tbytearray\x93C\x02xy\x85R.");
    assert_eq!(v, Value::Bytes(b"xy".to_vec()));
    assert!(
        err(b"c_codecs\nencode\n\x8c\x03\xe2\x82\xac\x8c\x06latin1\x86R.")
            .contains("is not latin-1")
    );
    assert!(err(b"c_codecs\nencode\n\x8c\x01x\x8c\x05rot13\x86R.").contains("unsupported encoding"));
    assert!(err(b"ccollections\nOrderedDict\nK\x01\x85R.").contains("expects a list"));
    // complex stays an object
    let v = ok(b"c__builtin__\ncomplex\nG?\xf0\x00\x00\x00\x00\x00\x00G@\x00\x00\x00\x00\x00\x00\x00\x86R.");
    assert!(v.is_object("builtins", "complex"));
}

#[test]
fn persistent_ids() {
    // torch storage persistent id: ('storage', torch.FloatStorage, '0', 'cpu', 12)
    let v = ok(b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQ.");
    let pid = v
        .as_persistent_id()
        .and_then(Value::as_list)
        .expect("pid tuple");
    assert_eq!(pid[0], s("storage"));
    assert!(pid[1].is_global("torch", "FloatStorage"));
    assert_eq!(pid[4], Value::Int(12));
    assert_eq!(ok(b"Pabc\n."), Value::PersistentId(Box::new(s("abc"))));
}

// --- hostile input -------------------------------------------------------------------

#[test]
fn truncation() {
    assert_eq!(
        err(b"X\x0a\x00\x00\x00abc"),
        "truncated at byte 0 (BINUNICODE needs 7 more bytes)"
    );
    assert_eq!(
        err(b"J\x01"),
        "truncated at byte 0 (BININT needs 3 more bytes)"
    );
    assert_eq!(
        err(b"\x8e\xff\xff\xff\xff\xff\xff\xff\xff"),
        format!(
            "truncated at byte 0 (BINBYTES8 needs {} more bytes)",
            u64::MAX
        )
    );
    assert!(err(b"cos\nsys").starts_with("truncated at byte 0 (GLOBAL"));
    assert_eq!(err(b"K\x01"), "input ends at byte 2 without a STOP opcode");
    assert_eq!(err(b""), "input ends at byte 0 without a STOP opcode");
}

#[test]
fn bad_opcodes() {
    assert_eq!(err(b"K\x01\xff."), "unknown opcode 0xff at byte 2");
    assert_eq!(err(b"\x97."), "unsupported opcode NEXT_BUFFER at byte 0");
    assert_eq!(
        err(b"N\x98."),
        "unsupported opcode READONLY_BUFFER at byte 1"
    );
    assert_eq!(err(b"\x82\x01."), "unsupported opcode EXT1 at byte 0");
    assert_eq!(err(b"S'a'\n."), "unsupported opcode STRING at byte 0");
}

#[test]
fn expansion_bomb() {
    // l = [0]; repeat 40 times: l = [l, l]  (tuple doubling through the memo)
    let mut b = b"\x80\x04K\x00\x94".to_vec(); // memo 0
    for i in 0..40u32 {
        b.extend_from_slice(b"j");
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(b"j");
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(b"\x86\x94"); // TUPLE2, MEMOIZE as i+1
    }
    b.push(b'.');
    let e = err(&b);
    assert_eq!(e, "pickle expands beyond 1000000 values");
}

#[test]
fn expansion_bomb_via_self_appends() {
    // A memoised list appended to a second list again and again, then that list
    // appended to a third ..., 30 levels of 2x.
    let mut b = b"]\x94K\x01a".to_vec();
    for i in 0..30u32 {
        b.extend_from_slice(b"](");
        b.extend_from_slice(b"j");
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(b"j");
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(b"e\x94");
    }
    b.push(b'.');
    assert!(err(&b).starts_with("pickle expands beyond"));
}

#[test]
fn byte_expansion_bomb() {
    // A 1 MiB string referenced 100 times, and that list 100 times: the byte budget
    // max(64 MiB, 64 x input) is exceeded long before 10 GiB would be copied.
    let n = 1 << 20;
    let mut b = vec![0x8d];
    b.extend_from_slice(&(n as u64).to_le_bytes());
    b.extend(std::iter::repeat_n(b'a', n));
    b.extend_from_slice(b"\x94](");
    for _ in 0..100 {
        b.extend_from_slice(b"h\x00");
    }
    b.extend_from_slice(b"e"); // list of 100 refs
    b.extend_from_slice(b"\x94(");
    for _ in 0..100 {
        b.extend_from_slice(b"h\x01");
    }
    b.extend_from_slice(b"t."); // tuple of 100 such lists = 10_000 MiB of text
    assert!(err(&b).starts_with("pickle expands beyond"));
    assert!(err(&b).ends_with("bytes"));
}

#[test]
fn copy_bomb_in_reduce() {
    // set(L) repeated many times on a large memoised list: metered copies.
    let g = Globals::from_pairs(&[("builtins", "set")]);
    let mut b = b"\x80\x04]\x94(".to_vec();
    for _ in 0..20_000 {
        b.extend_from_slice(b"N");
    }
    b.extend_from_slice(b"e\x8c\x08builtins\x8c\x03set\x93\x94h\x00\x85\x94]("); // memo 1 = set, 2 = (L,)
    for _ in 0..20_000 {
        b.extend_from_slice(b"h\x01h\x02R0");
    }
    b.extend_from_slice(b"N.");
    let e = parse(&b, &g).expect_err("bomb");
    assert!(e.to_string().starts_with("pickle expands beyond"), "{e}");
}

#[test]
fn deep_nesting() {
    // MAX_DEPTH + 1 nested lists: [[[...]]]
    let mut b = vec![b']'; MAX_DEPTH + 1];
    b.extend(vec![b'a'; MAX_DEPTH]);
    b.push(b'.');
    assert_eq!(err(&b), "nesting deeper than 1000 levels");
    // Exactly at the limit is fine.
    let mut b = vec![b']'; MAX_DEPTH];
    b.extend(vec![b'a'; MAX_DEPTH - 1]);
    b.push(b'.');
    assert!(p(&b).is_ok());
}

#[test]
fn too_many_marks() {
    let b: Vec<u8> = std::iter::repeat_n(b'(', MAX_MARKS + 1).collect();
    assert!(err(&b).starts_with(&format!("MARK depth exceeds {MAX_MARKS}")));
}

#[test]
fn recursive_structure() {
    // l = []; l.append(l)
    assert_eq!(
        err(b"]\x94h\x00a."),
        "recursive structure: a list contains itself"
    );
    // d = {}; d['x'] = [d]
    assert!(err(b"}\x94\x8c\x01x]h\x00as.").starts_with("recursive structure"));
}

#[test]
fn shared_values_are_copied() {
    // A memoised value used 3 times materialises 3 times (no cycle).
    let v = ok(b"\x8c\x01a\x94h\x00h\x00\x87.");
    assert_eq!(v, Value::Tuple(vec![s("a"), s("a"), s("a")]));
}

#[test]
fn accessors() {
    let v = Value::Dict(vec![(s("k"), Value::Float(1.0))]);
    assert_eq!(v.get("k").and_then(Value::as_f64), Some(1.0));
    assert_eq!(Value::Int(3).as_f64(), Some(3.0));
    assert_eq!(Value::Bool(true).as_int(), None);
    assert_eq!(Value::Bool(true).as_bool(), Some(true));
    assert!(Value::None.is_none());
    assert_eq!(Value::Bytes(vec![1]).as_bytes(), Some(&[1u8][..]));
    assert_eq!(Value::List(vec![]).kind(), "list");
    let obj = Value::Object {
        module: "m".into(),
        name: "C".into(),
        args: vec![],
        state: Some(Box::new(Value::Tuple(vec![
            Value::Dict(vec![(s("a"), Value::Int(1))]),
            Value::None,
        ]))),
    };
    assert_eq!(obj.get("a"), Some(&Value::Int(1)));
    assert_eq!(obj.class(), Some(("m", "C")));
    assert_eq!(Value::Tuple(vec![s("x")]).as_int_tuple(), None);
}

// --- real files (tests/data/pickle, copied from /work/shared/fixtures/dcp) ------------

fn data(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/pickle")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn chunks(tsm: &Value) -> Vec<(Vec<i64>, Vec<i64>)> {
    tsm.get("chunks")
        .and_then(Value::as_list)
        .expect("chunks")
        .iter()
        .map(|c| {
            (
                c.get("offsets")
                    .and_then(Value::as_int_tuple)
                    .expect("offsets"),
                c.get("sizes").and_then(Value::as_int_tuple).expect("sizes"),
            )
        })
        .collect()
}

/// storage_data lookup by (fqn, offsets): keys are MetadataIndex objects.
fn storage<'v>(md: &'v Value, fqn: &str, offsets: Option<&[i64]>) -> &'v Value {
    md.get("storage_data")
        .and_then(Value::as_dict)
        .expect("storage_data")
        .iter()
        .find(|(k, _)| {
            k.is_object("torch.distributed.checkpoint.metadata", "MetadataIndex")
                && k.get("fqn").and_then(Value::as_str) == Some(fqn)
                && k.get("offset").and_then(Value::as_int_tuple).as_deref() == offsets
        })
        .map(|(_, v)| v)
        .expect("storage entry")
}

#[test]
fn real_torch215_metadata_fsdp2_w2_f32() {
    let bytes = data("fsdp2_w2_f32.metadata");
    let md = parse(&bytes, &dcp_metadata_globals()).expect("parse .metadata");
    assert!(md.is_object("torch.distributed.checkpoint.metadata", "Metadata"));
    assert_eq!(md.get("version"), Some(&s("1.0.0")));
    let sdm = md
        .get("state_dict_metadata")
        .and_then(Value::as_dict)
        .expect("state_dict_metadata");
    // Expected values from fixtures/dcp/fsdp2_w2_f32/oracle/manifest.json:
    // 99 keys (76 tensors, 23 BYTE_IO), model.cls shape (3,12) with chunks
    // offsets (0,0) sizes (2,12) in __0_0.distcp @0 len 1641 and
    // offsets (2,0) sizes (1,12) in __1_0.distcp @29323 len 1577.
    assert_eq!(sdm.len(), 99);
    let n_bytes = sdm
        .iter()
        .filter(|(_, v)| {
            v.is_object(
                "torch.distributed.checkpoint.metadata",
                "BytesStorageMetadata",
            )
        })
        .count();
    assert_eq!(n_bytes, 23);
    assert_eq!(sdm[0].0, s("model.cls"));
    let cls = &sdm[0].1;
    assert!(cls.is_object(
        "torch.distributed.checkpoint.metadata",
        "TensorStorageMetadata"
    ));
    assert_eq!(
        cls.get("size").and_then(Value::as_int_tuple),
        Some(vec![3, 12])
    );
    assert_eq!(
        chunks(cls),
        vec![(vec![0, 0], vec![2, 12]), (vec![2, 0], vec![1, 12])]
    );
    // TensorProperties: 6-tuple state in 2.15 (dtype, layout, requires_grad, memfmt,
    // pin_memory, strides)
    let props = cls.get("properties").expect("properties");
    assert!(props.is_object("torch.distributed.checkpoint.metadata", "TensorProperties"));
    let st = props.state().and_then(Value::as_list).expect("state tuple");
    assert_eq!(st.len(), 6);
    assert!(st[0].is_global("torch", "float32"));
    assert!(st[1].is_object("torch.serialization", "_get_layout"));
    assert_eq!(st[2], Value::Bool(false));
    assert!(st[3].is_object(
        "torch.distributed.checkpoint.metadata",
        "_MEM_FORMAT_ENCODING"
    ));
    assert_eq!(st[5].as_int_tuple(), Some(vec![12, 1]));
    // optimizer.state.cls.step is 0-d: size (), one chunk () / ()
    let step = sdm
        .iter()
        .find(|(k, _)| k.as_str() == Some("optimizer.state.cls.step"))
        .map(|(_, v)| v)
        .expect("step");
    assert_eq!(step.get("size").and_then(Value::as_int_tuple), Some(vec![]));
    assert_eq!(chunks(step), vec![(vec![], vec![])]);
    // planner_data: flat key -> path tuple (ints are list indices)
    let pd = md.get("planner_data").expect("planner_data");
    assert_eq!(
        pd.get("model.embed.weight"),
        Some(&Value::Tuple(vec![s("model"), s("embed.weight")]))
    );
    assert_eq!(
        pd.get("optimizer.param_groups.0.lr"),
        Some(&Value::Tuple(vec![
            s("optimizer"),
            s("param_groups"),
            Value::Int(0),
            s("lr")
        ]))
    );
    // storage_data: 124 chunks + 23 BYTE_IO items, keyed by MetadataIndex objects
    let sd = md
        .get("storage_data")
        .and_then(Value::as_dict)
        .expect("storage_data");
    assert_eq!(sd.len(), 124 + 23);
    let c1 = storage(&md, "model.cls", Some(&[2, 0]));
    assert!(c1.is_object("torch.distributed.checkpoint.filesystem", "_StorageInfo"));
    assert_eq!(c1.get("relative_path"), Some(&s("__1_0.distcp")));
    assert_eq!(c1.get("offset"), Some(&Value::Int(29323)));
    assert_eq!(c1.get("length"), Some(&Value::Int(1577)));
    let c0 = storage(&md, "model.cls", Some(&[0, 0]));
    assert_eq!(c0.get("relative_path"), Some(&s("__0_0.distcp")));
    assert_eq!(c0.get("offset"), Some(&Value::Int(0)));
    assert_eq!(c0.get("length"), Some(&Value::Int(1641)));
    // BYTE_IO key: MetadataIndex without 'offset'; extra.note in __1_0.distcp @28062 len 1261
    let note = storage(&md, "extra.note", None);
    assert_eq!(note.get("offset"), Some(&Value::Int(28062)));
    assert_eq!(note.get("length"), Some(&Value::Int(1261)));
    // storage_meta: StorageMeta with a PosixPath checkpoint_id
    let sm = md.get("storage_meta").expect("storage_meta");
    assert!(sm.is_object("torch.distributed.checkpoint.metadata", "StorageMeta"));
    assert!(sm
        .get("checkpoint_id")
        .is_some_and(|c| c.is_object("pathlib", "PosixPath")));
    // Without the allow-list the first global is named.
    let e = parse(&bytes, &Globals::new()).expect_err("no globals");
    assert_eq!(
        e.to_string(),
        "unknown global `torch.distributed.checkpoint.metadata.Metadata` at byte 62"
    );
}

#[test]
fn real_torch21_metadata_shardedtensor_w3() {
    let bytes = data("torch21_shardedtensor_w3.metadata");
    let md = parse(&bytes, &dcp_metadata_globals()).expect("parse .metadata");
    // torch 2.1: no storage_meta, no version
    assert_eq!(md.get("version"), None);
    assert_eq!(md.get("storage_meta"), None);
    let sdm = md
        .get("state_dict_metadata")
        .and_then(Value::as_dict)
        .expect("state_dict_metadata");
    // Expected values from fixtures/dcp/torch21_shardedtensor_w3/oracle/manifest.json:
    // 9 keys; sharded.w_dim0_13x4 (13,4) chunks (0,0)/(5,4) (5,0)/(5,4) (10,0)/(3,4);
    // sharded.w_dim1_4x11 (4,11) chunks (0,0)/(4,4) (0,4)/(4,4) (0,8)/(4,3);
    // plain.scalar_f32 0-d; 'py' BYTE_IO in __0_0.distcp @0 len 928.
    assert_eq!(sdm.len(), 9);
    let get = |k: &str| {
        sdm.iter()
            .find(|(key, _)| key.as_str() == Some(k))
            .map(|(_, v)| v)
            .expect("key")
    };
    let w0 = get("sharded.w_dim0_13x4");
    assert_eq!(
        w0.get("size").and_then(Value::as_int_tuple),
        Some(vec![13, 4])
    );
    assert_eq!(
        chunks(w0),
        vec![
            (vec![0, 0], vec![5, 4]),
            (vec![5, 0], vec![5, 4]),
            (vec![10, 0], vec![3, 4])
        ]
    );
    let w1 = get("sharded.w_dim1_4x11");
    assert_eq!(
        chunks(w1),
        vec![
            (vec![0, 0], vec![4, 4]),
            (vec![0, 4], vec![4, 4]),
            (vec![0, 8], vec![4, 3])
        ]
    );
    let props = w0.get("properties").expect("properties");
    assert!(props.is_object(
        "torch.distributed._shard.sharded_tensor.metadata",
        "TensorProperties"
    ));
    assert_eq!(
        props.state().and_then(Value::as_list).map(<[Value]>::len),
        Some(5)
    );
    let bf16 = get("sharded.bf16_dim0_7x3")
        .get("properties")
        .and_then(Value::state);
    assert!(bf16
        .and_then(Value::as_list)
        .is_some_and(|st| st[0].is_global("torch", "bfloat16")));
    assert_eq!(
        get("plain.scalar_f32")
            .get("size")
            .and_then(Value::as_int_tuple),
        Some(vec![])
    );
    assert!(get("py").is_object(
        "torch.distributed.checkpoint.metadata",
        "BytesStorageMetadata"
    ));
    let py = storage(&md, "py", None);
    assert_eq!(py.get("relative_path"), Some(&s("__0_0.distcp")));
    assert_eq!(py.get("offset"), Some(&Value::Int(0)));
    assert_eq!(py.get("length"), Some(&Value::Int(928)));
    let c = storage(&md, "sharded.w_dim0_13x4", Some(&[10, 0]));
    assert_eq!(c.get("relative_path"), Some(&s("__2_0.distcp")));
    assert_eq!(c.get("offset"), Some(&Value::Int(0)));
    assert_eq!(c.get("length"), Some(&Value::Int(1180)));
}

/// Check a `_rebuild_tensor_v2/v3` call and return (storage class, key, numel, offset,
/// size, stride).
fn rebuild(v: &Value) -> (String, String, i64, i64, Vec<i64>, Vec<i64>) {
    let args = v.args().expect("rebuild args");
    let pid = args[0]
        .as_persistent_id()
        .and_then(Value::as_list)
        .expect("pid");
    assert_eq!(pid[0], s("storage"));
    assert_eq!(pid[3], s("cpu"));
    let (m, n) = pid[1].as_global().expect("storage class");
    (
        format!("{m}.{n}"),
        pid[2].as_str().expect("key").to_owned(),
        pid[4].as_int().expect("numel"),
        args[1].as_int().expect("storage_offset"),
        args[2].as_int_tuple().expect("size"),
        args[3].as_int_tuple().expect("stride"),
    )
}

#[test]
fn real_tensor_items() {
    // Expected values from fixtures/dcp/fsdp2_w2_f32/oracle/manifest.json, model.cls
    // chunk 0: FloatStorage key '0', numel 24, offset 0, size (2,12), stride (12,1).
    let v = parse(
        &data("fsdp2_w2_f32_model.cls_chunk0.data.pkl"),
        &torch_save_globals(),
    )
    .expect("parse");
    assert!(v.is_object("torch._utils", "_rebuild_tensor_v2"));
    assert_eq!(
        rebuild(&v),
        (
            "torch.FloatStorage".into(),
            "0".into(),
            24,
            0,
            vec![2, 12],
            vec![12, 1]
        )
    );
    let args = v.args().expect("args");
    assert_eq!(args[4], Value::Bool(false));
    assert_eq!(args[5], Value::Dict(vec![])); // OrderedDict()
                                              // extra.u16: _rebuild_tensor_v3, UntypedStorage numel counts BYTES (8 for 4 x u16),
                                              // trailing dtype torch.uint16.
    let v = parse(
        &data("fsdp2_w2_f32_extra.u16.data.pkl"),
        &torch_save_globals(),
    )
    .expect("parse");
    assert!(v.is_object("torch._utils", "_rebuild_tensor_v3"));
    assert_eq!(
        rebuild(&v),
        (
            "torch.storage.UntypedStorage".into(),
            "0".into(),
            8,
            0,
            vec![4],
            vec![1]
        )
    );
    assert!(v.args().expect("args")[6].is_global("torch", "uint16"));
    // The DCP allow-list does not allow tensor rebuilds.
    let e = parse(
        &data("fsdp2_w2_f32_model.cls_chunk0.data.pkl"),
        &dcp_metadata_globals(),
    )
    .expect_err("not allowed");
    assert_eq!(
        e.to_string(),
        "unknown global `torch._utils._rebuild_tensor_v2` at byte 2"
    );
}

#[test]
fn real_byte_io_items() {
    let g = torch_save_globals();
    // nontensor.json: optimizer.param_groups.0.betas = [0.9, 0.95] (a tuple)
    let v = parse(&data("fsdp2_w2_f32_betas.data.pkl"), &g).expect("betas");
    assert_eq!(v, Value::Tuple(vec![Value::Float(0.9), Value::Float(0.95)]));
    // torch21_shardedtensor_w3 'py' = {lr: 0.001, name: 'tiny', ints: [1,2,3], flag: true, none: null}
    let v = parse(&data("torch21_shardedtensor_w3_py.data.pkl"), &g).expect("py");
    assert_eq!(
        v,
        Value::Dict(vec![
            (s("lr"), Value::Float(0.001)),
            (s("name"), s("tiny")),
            (
                s("ints"),
                Value::List(vec![Value::Int(1), Value::Int(2), Value::Int(3)])
            ),
            (s("flag"), Value::Bool(true)),
            (s("none"), Value::None),
        ])
    );
    // fabric torch 2.1 optimizer.param_groups: one item with the whole list of dicts
    let v = parse(&data("fabric_torch21_param_groups.data.pkl"), &g).expect("param_groups");
    let groups = v.as_list().expect("list");
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].get("lr"), Some(&Value::Float(0.01)));
    assert_eq!(groups[0].get("fused"), Some(&Value::None));
    let params = groups[0]
        .get("params")
        .and_then(Value::as_list)
        .expect("params");
    assert_eq!(params.len(), 16);
    assert_eq!(params[0], s("cls"));
    assert_eq!(params[15], s("head.bias"));
    // fabric meta.pt data.pkl = {'step': 1}
    let v = parse(&data("fabric_torch21_meta.pt.data.pkl"), &g).expect("meta.pt");
    assert_eq!(v, Value::Dict(vec![(s("step"), Value::Int(1))]));
}

#[test]
fn real_metadata_prefixes_never_panic() {
    // Every truncation of a real file is an error (never a panic) except the full file.
    let bytes = data("torch21_shardedtensor_w3.metadata");
    let g = dcp_metadata_globals();
    for n in 0..bytes.len() {
        assert!(parse(&bytes[..n], &g).is_err(), "prefix {n}");
    }
}

// --- non-tensor values torch saves beside tensors ------------------------------------

/// `pickle.dumps(io.BytesIO(b"abc"), protocol=2)` after `seek(1)`, as `torch.save` writes it.
const BYTES_IO: &[u8] = b"\x80\x02c_io\nBytesIO\nq\x00)\x81q\x01c_codecs\nencode\nq\x02X\x03\x00\x00\x00abcq\x03X\x06\x00\x00\x00latin1q\x04\x86q\x05Rq\x06K\x01N\x87q\x07b.";

#[test]
fn a_bytes_io_is_a_value_and_a_user_class_stays_unknown() {
    let v = parse(BYTES_IO, &torch_save_globals()).unwrap();
    let state = Value::Tuple(vec![
        Value::Bytes(b"abc".to_vec()),
        Value::Int(1),
        Value::None,
    ]);
    assert_eq!(
        v,
        Value::Object {
            module: "_io".into(),
            name: "BytesIO".into(),
            args: vec![],
            state: Some(Box::new(state)),
        }
    );
    // re-emitted as the same object: the pickle the writers make of it reads back equal
    let again = crate::torch::pickle::pickle(&crate::torch::pickle::from_pickle(&v).unwrap());
    assert_eq!(parse(&again, &torch_save_globals()).unwrap(), v);
    // a class of the training script is still refused, by name (DCP keeps such an item
    // opaque), and so is anything hostile
    let user = b"\x80\x02cmymod\nTrainState\nq\x00)\x81q\x01.";
    match parse(user, &torch_save_globals()) {
        Err(PickleError::UnknownGlobal { module, name, .. }) => {
            assert_eq!((module.as_str(), name.as_str()), ("mymod", "TrainState"))
        }
        other => panic!("expected an unknown global, got {other:?}"),
    }
    let hostile = b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.";
    assert!(matches!(
        parse(hostile, &torch_save_globals()),
        Err(PickleError::UnknownGlobal { .. })
    ));
}

// --- getattr of a nested class -------------------------------------------------------

#[test]
fn getattr_names_an_allow_listed_nested_class_only() {
    // getattr(m.C, "Inner")() — how pickle names a nested class (protocol 2)
    let pk = b"\x80\x02c__builtin__\ngetattr\ncm\nC\nX\x05\x00\x00\x00Inner\x86R)\x81.";
    let mut g = all();
    g.allow("builtins", "getattr");
    // not allowed: m.C.Inner is not on the list
    let e = parse(pk, &g).unwrap_err().to_string();
    assert!(e.contains("m.C.Inner"), "{e}");
    g.allow("m", "C.Inner");
    let v = parse(pk, &g).unwrap();
    assert!(v.class() == Some(("m", "C.Inner")), "{v:?}");
    // getattr of anything but an allow-listed global and a name is refused
    let pk = b"\x80\x02c__builtin__\ngetattr\nK\x01X\x05\x00\x00\x00Inner\x86R.";
    let e = parse(pk, &g).unwrap_err().to_string();
    assert!(e.contains("getattr is only read"), "{e}");
}

/// `parse_graph_consuming` reports ever larger prefixes of the input as it goes, ending
/// with the whole input, and its graph outlives the input: a list of 700,000 strings (over
/// twice the reporting step, so reported on the way too), read back after the input is
/// dropped.
#[test]
fn graph_consuming_reports_prefixes_and_outlives_the_input() {
    use crate::torch::pickle::{pickle, PyValue};
    let items: Vec<String> = (0..700_000)
        .map(|i| format!("item number {i:>12}"))
        .collect();
    let bytes = pickle(&PyValue::List(
        items.iter().map(|s| PyValue::Str(s.clone())).collect(),
    ));
    let len = bytes.len();
    assert!(len > 2 * machine::CONSUMED_STEP);
    let mut seen = vec![];
    let graph = parse_graph_consuming(&bytes, &all(), |n| seen.push(n)).expect("decodes");
    drop(bytes);
    assert!(seen.len() >= 3, "reported {seen:?}");
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert!(seen[..seen.len() - 1]
        .iter()
        .all(|&n| n >= machine::CONSUMED_STEP && n < len));
    assert_eq!(seen.last(), Some(&len));
    let got: Vec<&str> = graph
        .root()
        .as_list()
        .expect("a list")
        .map(|o| o.as_str().expect("a str"))
        .collect();
    assert_eq!(got, items);
}
