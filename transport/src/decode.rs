//! The error and the byte reader every decoder of untrusted bytes shares: wire frames, FLOCK
//! messages, the memnode's RPC payloads, the region's superblock, the attach handshake and
//! the client's requests and replies.
//!
//! A [`Reader`] is a little-endian cursor over a byte slice: every read is bounds-checked
//! and fails with a [`DecodeError`] instead of panicking, whatever the input. It never
//! allocates on a peer's say-so: lengths come back as borrowed slices, after a check
//! against the bytes present and a caller's limit.

/// Bytes that do not decode, or values that make no sense: what was being decoded (the
/// prefix each decoder names itself by, such as `malformed frame`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {message}")]
pub struct DecodeError {
    /// What was being decoded, as the message's prefix.
    pub what: &'static str,
    /// Why it did not decode.
    pub message: String,
}

impl DecodeError {
    /// A failure to decode `what`, for the reason `message`.
    pub fn new(what: &'static str, message: impl Into<String>) -> Self {
        Self { what, message: message.into() }
    }
}

/// Little-endian cursor over untrusted bytes; its errors name `what` it decodes. A read that
/// fails consumes nothing.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    what: &'static str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `bytes`, a `what` (see [`DecodeError::what`]).
    pub fn new(what: &'static str, bytes: &'a [u8]) -> Self {
        Self { what, bytes, pos: 0 }
    }

    /// An error about this reader's `what`.
    pub fn error(&self, message: impl Into<String>) -> DecodeError {
        DecodeError::new(self.what, message)
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.bytes.len());
        let end =
            end.ok_or_else(|| self.error(format!("needs {n} bytes at {}, has {}", self.pos, self.bytes.len())))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// The next `n` bytes as a reader of their own (same `what`), for a section whose length
    /// is known up front.
    pub fn sub(&mut self, n: usize) -> Result<Reader<'a>, DecodeError> {
        Ok(Reader::new(self.what, self.take(n)?))
    }

    /// The next byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    /// The next two bytes, little-endian.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_le_bytes)
    }

    /// The next four bytes, little-endian.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next eight bytes, little-endian.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A u32 length, then that many bytes; a length above `max` is refused before the bytes
    /// are looked for (so a caller copying them copies at most `max`).
    pub fn bytes_u32(&mut self, max: usize) -> Result<&'a [u8], DecodeError> {
        self.all_or_nothing(|r| {
            let len = r.u32()?;
            match usize::try_from(len) {
                Ok(len) if len <= max => r.take(len),
                _ => Err(r.error(format!("field of {len} bytes exceeds {max}"))),
            }
        })
    }

    /// Skips `n` bytes that must be zero (reserved fields stay zero so they can gain meaning).
    pub fn zeros(&mut self, n: usize) -> Result<(), DecodeError> {
        self.all_or_nothing(|r| match r.take(n)?.iter().all(|&b| b == 0) {
            true => Ok(()),
            false => Err(r.error("reserved bytes are not zero")),
        })
    }

    /// Runs `read`, and puts the cursor back where it was if it fails: a failed read of any
    /// kind consumes nothing.
    fn all_or_nothing<T>(&mut self, read: impl FnOnce(&mut Self) -> Result<T, DecodeError>) -> Result<T, DecodeError> {
        let start = self.pos;
        let out = read(self);
        if out.is_err() {
            self.pos = start;
        }
        out
    }

    /// Every byte not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.bytes[self.pos..];
        self.pos = self.bytes.len();
        out
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// Fails unless every byte was read.
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(self.error(format!("{n} trailing bytes"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_little_endian_and_tracks_what_is_left() {
        let bytes = [1, 2, 0, 3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 9, 8];
        let mut r = Reader::new("test", &bytes);
        assert_eq!((r.u8().unwrap(), r.u16().unwrap(), r.u32().unwrap()), (1, 2, 3));
        assert_eq!(r.u64().unwrap(), 4);
        assert_eq!(r.remaining(), 2);
        assert_eq!(r.finish().unwrap_err().to_string(), "test: 2 trailing bytes");
        assert_eq!(r.array::<2>().unwrap(), [9, 8]);
        r.finish().unwrap();
        assert_eq!(r.rest(), b"");
    }

    #[test]
    fn short_input_is_an_error_that_names_what_and_where() {
        let mut r = Reader::new("malformed thing", &[1, 2, 3]);
        r.u8().unwrap();
        let e = r.u32().unwrap_err();
        assert_eq!(e, DecodeError::new("malformed thing", "needs 4 bytes at 1, has 3"));
        assert_eq!(e.to_string(), "malformed thing: needs 4 bytes at 1, has 3");
        assert_eq!(r.remaining(), 2, "a failed read consumes nothing");
        assert!(r.take(usize::MAX).is_err(), "no overflow on a huge length");
    }

    #[test]
    fn reserved_bytes_must_be_zero() {
        assert!(Reader::new("t", &[0, 0]).zeros(2).is_ok());
        assert_eq!(Reader::new("t", &[0, 1]).zeros(2).unwrap_err().message, "reserved bytes are not zero");
    }

    #[test]
    fn length_prefixed_bytes_are_bounded_before_they_are_looked_for() {
        let mut field = 3u32.to_le_bytes().to_vec();
        field.extend_from_slice(b"abc");
        assert_eq!(Reader::new("t", &field).bytes_u32(3).unwrap(), b"abc");
        assert_eq!(Reader::new("t", &field).bytes_u32(2).unwrap_err().message, "field of 3 bytes exceeds 2");
        let huge = u32::MAX.to_le_bytes();
        assert!(Reader::new("t", &huge).bytes_u32(usize::MAX).is_err(), "claims more than is there");
    }

    #[test]
    fn a_sub_reader_covers_its_section_only() {
        let mut r = Reader::new("t", &[1, 2, 3]);
        let mut head = r.sub(2).unwrap();
        assert_eq!((head.u8().unwrap(), head.remaining()), (1, 1));
        assert_eq!(head.u16().unwrap_err().what, "t");
        assert_eq!(r.rest(), [3]);
        assert!(r.sub(1).is_err());
    }

    /// One call of the reader's methods, for the property below.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        U8,
        U16,
        U32,
        U64,
        Array3,
        Take(usize),
        Sub(usize),
        Zeros(usize),
        BytesU32(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::U8),
            Just(Step::U16),
            Just(Step::U32),
            Just(Step::U64),
            Just(Step::Array3),
            (0usize..70).prop_map(Step::Take),
            (0usize..70).prop_map(Step::Sub),
            (0usize..6).prop_map(Step::Zeros),
            (0usize..70).prop_map(Step::BytesU32),
        ]
    }

    /// What `step` should do at `left` (the unread bytes): None to fail, or the bytes it
    /// consumes and the bytes it returns.
    fn model(step: Step, left: &[u8]) -> Option<(usize, &[u8])> {
        let fixed = |n: usize| left.get(..n).map(|b| (n, b));
        match step {
            Step::U8 => fixed(1),
            Step::U16 => fixed(2),
            Step::U32 => fixed(4),
            Step::U64 => fixed(8),
            Step::Array3 => fixed(3),
            Step::Take(n) | Step::Sub(n) => fixed(n),
            Step::Zeros(n) => fixed(n).filter(|(_, b)| b.iter().all(|&b| b == 0)).map(|(n, _)| (n, &[][..])),
            Step::BytesU32(max) => {
                let len = u32::from_le_bytes(left.get(..4)?.try_into().unwrap()) as usize;
                (len <= max).then(|| left.get(4..4 + len).map(|b| (4 + len, b)))?
            }
        }
    }

    fn run(r: &mut Reader<'_>, step: Step) -> Result<Vec<u8>, DecodeError> {
        Ok(match step {
            Step::U8 => vec![r.u8()?],
            Step::U16 => r.u16()?.to_le_bytes().to_vec(),
            Step::U32 => r.u32()?.to_le_bytes().to_vec(),
            Step::U64 => r.u64()?.to_le_bytes().to_vec(),
            Step::Array3 => r.array::<3>()?.to_vec(),
            Step::Take(n) => r.take(n)?.to_vec(),
            Step::Sub(n) => r.sub(n)?.rest().to_vec(),
            Step::Zeros(n) => r.zeros(n).map(|()| Vec::new())?,
            Step::BytesU32(max) => r.bytes_u32(max)?.to_vec(),
        })
    }

    proptest! {
        /// Against a model of every method, on any bytes: nothing panics, a read succeeds
        /// exactly when its bytes are there (and within bounds), returns them and consumes
        /// them, and a failed read consumes nothing.
        #[test]
        fn reads_match_the_model(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            steps in proptest::collection::vec(step(), 0..16),
        ) {
            let mut r = Reader::new("t", &bytes);
            let mut pos = 0;
            for step in steps {
                let expected = model(step, &bytes[pos..]);
                match (run(&mut r, step), expected) {
                    (Ok(got), Some((consumed, want))) => {
                        prop_assert_eq!(&got[..], want, "{:?}", step);
                        pos += consumed;
                    }
                    (Err(e), None) => prop_assert_eq!(e.what, "t"),
                    (got, want) => prop_assert!(false, "{:?} at {}: got {:?}, the model says {:?}", step, pos, got, want),
                }
                prop_assert_eq!(r.remaining(), bytes.len() - pos);
            }
            prop_assert_eq!(r.finish().is_ok(), pos == bytes.len());
            prop_assert_eq!(r.rest(), &bytes[pos..]);
            prop_assert!(r.finish().is_ok());
        }
    }
}
