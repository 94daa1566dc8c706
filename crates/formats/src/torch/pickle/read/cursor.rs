//! The input cursor: bounds-checked reads of a pickle's operands (fixed-width integers,
//! length-prefixed byte runs, `\n`-terminated lines), each failing as [`PickleError::Truncated`]
//! with the offset and name of the opcode being read.

use super::PickleError;

/// A cursor over the input.
pub(super) struct Reader<'a> {
    data: &'a [u8],
    /// Offset of the next byte to read.
    pub(super) pos: usize,
}

/// Reader methods for little-endian operands of the named integer types.
macro_rules! le_operands {
    ($($(#[$doc:meta])* $t:ident;)*) => {$(
        $(#[$doc])*
        #[inline]
        pub(super) fn $t(&mut self, opcode: &'static str, at: usize) -> Result<$t, PickleError> {
            Ok($t::from_le_bytes(self.array(opcode, at)?))
        }
    )*};
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `data`.
    pub(super) fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }

    /// Bytes left after the cursor.
    #[inline]
    pub(super) fn remaining(&self) -> usize {
        self.data.len().saturating_sub(self.pos)
    }

    /// The next byte (the next opcode), `None` at the end of the input.
    #[inline]
    pub(super) fn next_byte(&mut self) -> Option<u8> {
        let b = self.data.get(self.pos).copied()?;
        self.pos += 1;
        Some(b)
    }

    /// Take `n` bytes, checking `n` against the remaining input before anything else.
    #[inline]
    pub(super) fn take(
        &mut self,
        n: u64,
        opcode: &'static str,
        at: usize,
    ) -> Result<&'a [u8], PickleError> {
        let rem = self.remaining();
        let truncated = PickleError::Truncated {
            offset: at,
            opcode,
            needed: n.saturating_sub(rem as u64),
        };
        let n = match usize::try_from(n) {
            Ok(n) if n <= rem => n,
            _ => return Err(truncated),
        };
        let end = self.pos.checked_add(n).ok_or(truncated)?;
        let slice = self.data.get(self.pos..end).ok_or(PickleError::Truncated {
            offset: at,
            opcode,
            needed: 1,
        })?;
        self.pos = end;
        Ok(slice)
    }

    /// The next `N` bytes.
    #[inline]
    pub(super) fn array<const N: usize>(
        &mut self,
        opcode: &'static str,
        at: usize,
    ) -> Result<[u8; N], PickleError> {
        let s = self.take(N as u64, opcode, at)?;
        <[u8; N]>::try_from(s).map_err(|_| PickleError::Truncated {
            offset: at,
            opcode,
            needed: N as u64,
        })
    }

    /// A `u8` operand.
    #[inline]
    pub(super) fn u8(&mut self, opcode: &'static str, at: usize) -> Result<u8, PickleError> {
        Ok(self.array::<1>(opcode, at)?[0])
    }

    le_operands! {
        /// A little-endian `u16` operand.
        u16;
        /// A little-endian `u32` operand.
        u32;
        /// A little-endian `i32` operand.
        i32;
        /// A little-endian `u64` operand.
        u64;
    }

    /// A `\n`-terminated line (text opcodes), without the newline.
    #[inline]
    pub(super) fn line(
        &mut self,
        opcode: &'static str,
        at: usize,
    ) -> Result<&'a [u8], PickleError> {
        let rest = self.data.get(self.pos..).unwrap_or(&[]);
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            return Err(PickleError::Truncated {
                offset: at,
                opcode,
                needed: 1,
            });
        };
        let line = rest.get(..nl).unwrap_or(&[]);
        self.pos = self.pos.saturating_add(nl).saturating_add(1);
        Ok(line)
    }
}

// ---------------------------------------------------------------------------------------------
// Memo
