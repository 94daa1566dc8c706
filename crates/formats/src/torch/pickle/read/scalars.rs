//! Scalar opcodes: ints (`INT`, `LONG`, `BININT*`, `LONG1`/`LONG4`), floats (`FLOAT`,
//! `BINFLOAT`), strings (`BINUNICODE*`, `UNICODE`) and bytes (`BINBYTES*`, `BINSTRING`s,
//! `BYTEARRAY8`), with the decoding of their operands.

use super::arena::{Id, Node};
use super::cursor::Reader;
use super::machine::Machine;
use super::machine::Step;
use super::{invalid, op, PickleError, MAX_TEXT_INT_DIGITS};

impl Machine<'_> {
    /// `INT`: a decimal int, or a bool as protocol 0 writes one (`01`/`00`).
    #[inline]
    pub(super) fn int(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let node = match line {
            b"01" => Node::Bool(true),
            b"00" => Node::Bool(false),
            _ => parse_text_int(line, name, at)?,
        };
        self.push_node(node, at)
    }

    /// `LONG`: a decimal int with an optional `L` suffix.
    #[inline]
    pub(super) fn long(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let line = line.strip_suffix(b"L").unwrap_or(line);
        let node = parse_text_int(line, name, at)?;
        self.push_node(node, at)
    }

    /// `BININT`: a 4-byte signed int.
    #[inline]
    pub(super) fn binint(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let v = r.i32(name, at)?;
        self.push_node(Node::Int(i64::from(v)), at)
    }

    /// `BININT1`: a 1-byte unsigned int, one shared node per value.
    #[inline]
    pub(super) fn binint1(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let v = r.u8(name, at)?;
        let id = self.small_int(v, at)?;
        self.push(id, at)
    }

    /// `BININT2`: a 2-byte unsigned int.
    #[inline]
    pub(super) fn binint2(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let v = r.u16(name, at)?;
        self.push_node(Node::Int(i64::from(v)), at)
    }

    /// The shared node of the small int `v`.
    #[inline]
    fn small_int(&mut self, v: u8, at: usize) -> Result<Id, PickleError> {
        let slot = usize::from(v);
        if self.small_ints[slot] == 0 {
            self.small_ints[slot] = self.alloc(Node::Int(i64::from(v)), at)?;
        }
        Ok(self.small_ints[slot])
    }

    /// `LONG1`/`LONG4`: a little-endian two's complement int of 1-byte/4-byte length.
    #[inline]
    pub(super) fn long_binary(
        &mut self,
        code: u8,
        r: &mut Reader<'_>,
        name: &'static str,
        at: usize,
    ) -> Step {
        let n = if code == op::LONG1 {
            u64::from(r.u8(name, at)?)
        } else {
            let n = r.i32(name, at)?;
            u64::try_from(n).map_err(|_| invalid(at, format!("negative LONG4 length {n}")))?
        };
        let bytes = r.take(n, name, at)?;
        self.push_node(int_from_le(bytes), at)
    }

    /// `FLOAT`: a float as decimal text.
    #[inline]
    pub(super) fn float(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let f = std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .ok_or_else(|| invalid(at, "invalid FLOAT literal"))?;
        self.push_node(Node::Float(f), at)
    }

    /// `BINFLOAT`: a big-endian 8-byte float.
    #[inline]
    pub(super) fn binfloat(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let f = f64::from_be_bytes(r.array(name, at)?);
        self.push_node(Node::Float(f), at)
    }

    /// `SHORT_BINUNICODE`/`BINUNICODE`/`BINUNICODE8`: utf-8 text of a 1/4/8-byte length.
    #[inline]
    pub(super) fn binunicode(
        &mut self,
        code: u8,
        r: &mut Reader<'_>,
        name: &'static str,
        at: usize,
    ) -> Step {
        let n = match code {
            op::SHORT_BINUNICODE => u64::from(r.u8(name, at)?),
            op::BINUNICODE => u64::from(r.u32(name, at)?),
            _ => r.u64(name, at)?,
        };
        let bytes = r.take(n, name, at)?;
        let s = std::str::from_utf8(bytes)
            .map_err(|_| invalid(at, format!("invalid utf-8 in {name}")))?;
        self.push_node(Node::Str(s.into()), at)
    }

    /// `UNICODE`: a line of raw-unicode-escape text (protocol 0).
    #[inline]
    pub(super) fn unicode(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let s = decode_raw_unicode_escape(line)
            .ok_or_else(|| invalid(at, "invalid raw-unicode-escape in UNICODE"))?;
        self.push_node(Node::Str(s.into()), at)
    }

    /// `SHORT_BINSTRING`/`BINSTRING` (Python 2 `str`), `SHORT_BINBYTES`/`BINBYTES`/`BINBYTES8`
    /// and `BYTEARRAY8`: bytes of a 1/4/8-byte length.
    #[inline]
    pub(super) fn binbytes(
        &mut self,
        code: u8,
        r: &mut Reader<'_>,
        name: &'static str,
        at: usize,
    ) -> Step {
        let n = match code {
            op::SHORT_BINSTRING | op::SHORT_BINBYTES => u64::from(r.u8(name, at)?),
            op::BINSTRING => {
                let n = r.i32(name, at)?;
                u64::try_from(n)
                    .map_err(|_| invalid(at, format!("negative BINSTRING length {n}")))?
            }
            op::BINBYTES => u64::from(r.u32(name, at)?),
            _ => r.u64(name, at)?,
        };
        let bytes = r.take(n, name, at)?;
        self.push_node(Node::Bytes(bytes.into()), at)
    }
}

/// Little-endian two's complement bytes (`LONG1`/`LONG4`) → `Int` or minimal `BigInt`.
fn int_from_le(bytes: &[u8]) -> Node {
    let mut len = bytes.len();
    // Drop redundant sign-extension bytes.
    while len > 1 {
        let (Some(&last), Some(&prev)) = (bytes.get(len - 1), bytes.get(len - 2)) else {
            break;
        };
        let redundant = (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
        if !redundant {
            break;
        }
        len -= 1;
    }
    let bytes = bytes.get(..len).unwrap_or(&[]);
    if bytes.is_empty() {
        return Node::Int(0);
    }
    if bytes.len() <= 8 {
        let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
        let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
        for (dst, src) in buf.iter_mut().zip(bytes) {
            *dst = *src;
        }
        return Node::Int(i64::from_le_bytes(buf));
    }
    Node::BigInt(bytes.into())
}

/// Decimal text (`INT`/`LONG`) → `Int` or `BigInt`.
fn parse_text_int(line: &[u8], opcode: &'static str, at: usize) -> Result<Node, PickleError> {
    let bad = || invalid(at, format!("invalid {opcode} literal"));
    let text = std::str::from_utf8(line).map_err(|_| bad())?.trim();
    if let Ok(v) = text.parse::<i64>() {
        return Ok(Node::Int(v));
    }
    let (negative, digits) = match text.as_bytes() {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        rest => (false, rest),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    if digits.len() > MAX_TEXT_INT_DIGITS {
        return Err(invalid(
            at,
            format!("{opcode} literal longer than {MAX_TEXT_INT_DIGITS} digits"),
        ));
    }
    // Magnitude, little-endian base 256.
    let mut mag: Vec<u8> = Vec::new();
    for d in digits {
        let mut carry = u32::from(d - b'0');
        for limb in mag.iter_mut() {
            let v = u32::from(*limb) * 10 + carry;
            *limb = (v & 0xff) as u8;
            carry = v >> 8;
        }
        while carry > 0 {
            mag.push((carry & 0xff) as u8);
            carry >>= 8;
        }
    }
    // Room for the sign bit.
    mag.push(0);
    if negative {
        // Two's complement: invert and add one.
        let mut carry = 1u16;
        for limb in mag.iter_mut() {
            let v = u16::from(!*limb) + carry;
            *limb = (v & 0xff) as u8;
            carry = v >> 8;
        }
    }
    Ok(int_from_le(&mag))
}

/// Python's `raw-unicode-escape` as written by protocol 0 `UNICODE`: bytes are latin-1
/// characters, except `\uXXXX` and `\UXXXXXXXX` escapes.
fn decode_raw_unicode_escape(line: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while let Some(&b) = line.get(i) {
        if b == b'\\' {
            let width = match line.get(i + 1) {
                Some(b'u') => 4,
                Some(b'U') => 8,
                _ => 0,
            };
            if width > 0 {
                let hex = line.get(i + 2..i + 2 + width)?;
                let hex = std::str::from_utf8(hex).ok()?;
                let cp = u32::from_str_radix(hex, 16).ok()?;
                out.push(char::from_u32(cp)?);
                i += 2 + width;
                continue;
            }
        }
        out.push(char::from(b));
        i += 1;
    }
    Some(out)
}
