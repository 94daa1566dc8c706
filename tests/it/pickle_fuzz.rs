//! Hostile-input tests for `reshard::formats::pickle`: mutated real DCP pickles and random
//! opcode soups must parse to `Ok` or `Err`, never panic, and finish in bounded time.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::Index;
use reshard::formats::torch::pickle::{dcp_metadata_globals, parse, torch_save_globals, Globals};

/// Generous: a 33 KB `.metadata` parses in a few milliseconds.
const TIME_LIMIT: Duration = Duration::from_secs(5);

fn data(name: &str) -> Vec<u8> {
    let path = crate::common::root().join("tests/data/pickle").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn globals() -> Globals {
    let mut g = dcp_metadata_globals();
    g.extend(&torch_save_globals());
    g
}

/// Real pickles the mutations start from.
fn seeds() -> Vec<Vec<u8>> {
    vec![
        data("fsdp2_w2_f32.metadata"),
        data("torch21_shardedtensor_w3.metadata"),
        data("fsdp2_w2_f32_model.cls_chunk0.data.pkl"),
        data("fabric_torch21_param_groups.data.pkl"),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    /// XOR one byte.
    Flip(Index, u8),
    /// Overwrite one byte (often with an opcode byte).
    Set(Index, u8),
    /// Cut the input at a position.
    Truncate(Index),
    /// Insert a few arbitrary bytes.
    Insert(Index, Vec<u8>),
    /// Remove a slice.
    Delete(Index, usize),
    /// Copy a slice of the input to another position (repeats memo references, marks, ...).
    Duplicate(Index, usize, Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        3 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        2 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        2 => (any::<Index>(), 1usize..256, any::<Index>(), 1usize..64)
            .prop_map(|(s, n, d, k)| Mutation::Duplicate(s, n, d, k)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        if let Mutation::Insert(_, b) = m {
            bytes.extend_from_slice(b);
        }
        return;
    }
    let len = bytes.len();
    match m {
        Mutation::Flip(i, x) => bytes[i.index(len)] ^= x,
        Mutation::Set(i, b) => bytes[i.index(len)] = *b,
        Mutation::Truncate(i) => bytes.truncate(i.index(len)),
        Mutation::Insert(i, b) => {
            let at = i.index(len + 1);
            bytes.splice(at..at, b.iter().copied());
        }
        Mutation::Delete(i, n) => {
            let at = i.index(len);
            let end = (at + n).min(len);
            bytes.drain(at..end);
        }
        Mutation::Duplicate(s, n, d, k) => {
            let start = s.index(len);
            let end = (start + n).min(len);
            let slice = bytes[start..end].to_vec();
            let at = d.index(len + 1);
            let copies: Vec<u8> = slice
                .iter()
                .copied()
                .cycle()
                .take(slice.len() * k)
                .collect();
            bytes.splice(at..at, copies);
        }
    }
}

fn check(bytes: &[u8], globals: &Globals) -> Result<(), TestCaseError> {
    let t0 = Instant::now();
    // Ok or Err are both fine; a panic fails the test case.
    let result = parse(bytes, globals);
    let elapsed = t0.elapsed();
    prop_assert!(
        elapsed < TIME_LIMIT,
        "parse of {} bytes took {elapsed:?} (result ok: {})",
        bytes.len(),
        result.is_ok()
    );
    if let Err(e) = result {
        // Error messages stay short: one line, no dump of the input.
        let msg = e.to_string();
        prop_assert!(!msg.contains('\n') && msg.len() < 300, "message: {msg:?}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_real_pickles_never_panic(
        seed in 0usize..4,
        mutations in prop::collection::vec(mutation(), 1..8),
    ) {
        let seeds = seeds();
        let mut bytes = seeds[seed].clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        check(&bytes, &globals())?;
    }
}

/// Fragments of valid opcodes, so random sequences reach deep into the interpreter
/// (memo, marks, calls, builds) instead of failing on the first byte.
const FRAGMENTS: &[&[u8]] = &[
    b"(",
    b")",
    b"]",
    b"}",
    b"N",
    b"\x88",
    b"\x89",
    b"K\x01",
    b"M\x00\x01",
    b"J\xff\xff\xff\xff",
    b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01",
    b"G?\xf0\x00\x00\x00\x00\x00\x00",
    b"\x8c\x01k",
    b"X\x01\x00\x00\x00v",
    b"C\x01b",
    b"a",
    b"e",
    b"l",
    b"t",
    b"d",
    b"s",
    b"u",
    b"\x85",
    b"\x86",
    b"\x87",
    b"\x8f",
    b"\x90",
    b"\x91",
    b"0",
    b"1",
    b"2",
    b"\x94",
    b"q\x00",
    b"q\x01",
    b"h\x00",
    b"h\x01",
    b"h\x02",
    b"j\x00\x00\x00\x00",
    b"R",
    b"\x81",
    b"\x92",
    b"b",
    b"Q",
    b"ctorch\nSize\n",
    b"ccollections\nOrderedDict\n",
    b"c__builtin__\nset\n",
    b"c_codecs\nencode\n",
    b"\x8c\x05torch\x8c\x07float32\x93",
    b"\x8c\x08builtins\x8c\x03set\x93",
    b"\x80\x02",
    b"\x80\x04",
    b"\x95\x01\x00\x00\x00\x00\x00\x00\x00",
    b"I7\n",
    b"L9L\n",
    b"F1.5\n",
    b"Vx\\u20ac\n",
    b"p0\n",
    b"g0\n",
    b"Pid\n",
    b"\x8c\x06latin1",
];

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_opcode_soup_never_panics(
        picks in prop::collection::vec(any::<Index>(), 0..200),
        with_stop in any::<bool>(),
    ) {
        let mut bytes = Vec::new();
        for p in &picks {
            bytes.extend_from_slice(FRAGMENTS[p.index(FRAGMENTS.len())]);
        }
        if with_stop {
            bytes.push(b'.');
        }
        check(&bytes, &globals())?;
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check(&bytes, &globals())?;
    }
}

/// The unmutated seeds parse.
#[test]
fn seeds_parse() {
    let g = globals();
    for (i, s) in seeds().iter().enumerate() {
        assert!(parse(s, &g).is_ok(), "seed {i}");
    }
}
