//! INCRBYFLOAT's arithmetic as redis-server does it on x86-64 Linux: C `long double`, the
//! x87 80-bit extended format (64-bit significand, 15-bit exponent), parsed by glibc's
//! `strtold` (correctly rounded), added with one rounding, printed by `%.17Lf` with trailing
//! zeros trimmed (Redis' `LD_STR_HUMAN`).
//!
//! `f64` would not do: `10.5 + 0.1` is `10.6` to Redis but `10.599999999999999644` in
//! doubles at 17 places, and `1e308 * 10` is finite in `long double`. So values are exact
//! `mantissa x 2^exp` and every step is done in exact integers (a small bignum below), then
//! rounded once to nearest, ties to even, as the x87 unit and glibc do.
//!
//! Work is bounded by the input: Redis refuses numbers of 5 KiB or more
//! ([`MAX_FLOAT_CHARS`]), decimal exponents are cut to the format's range before any power of
//! ten is built, and the largest integer handled is about 2^34000 (under 600 64-bit limbs).
//!
//! (Redis on aarch64 has 128-bit `long double`s and prints other digits: racekv follows
//! x86-64, where redis-server is usually run.)

use std::cmp::Ordering;

/// Longest number text Redis' `string2ld` takes (`MAX_LONG_DOUBLE_CHARS`, 5 KiB): texts of
/// this length or more are not valid floats.
pub const MAX_FLOAT_CHARS: usize = 5 * 1024;

/// Significand bits of the x87 extended format.
const MANT_BITS: i64 = 64;
/// Exponent (of the significand's last bit) of the smallest subnormal: 2^-16445.
const MIN_EXP: i64 = -16445;
/// Largest exponent with a 64-bit significand below 2^16384 (the format's overflow).
const MAX_EXP: i64 = 16384 - MANT_BITS;
/// Decimal exponents beyond these give infinity or zero whatever the digits (after the
/// digit count is taken into account), so no larger power of ten is ever built.
const MAX_DECIMAL_EXP: i64 = 4933;
const MIN_DECIMAL_EXP: i64 = -4951;

/// A finite extended-precision value: `(-1)^neg x mant x 2^exp`; zero has `mant == 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ext {
    neg: bool,
    mant: u64,
    exp: i64,
}

/// What `strtold` (as Redis checks it) makes of a text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parsed {
    Finite(Ext),
    /// `inf` or `infinity`, either sign: valid, but any sum with it is refused later.
    Infinite,
    /// Not a valid float for Redis: syntax, NaN, overflow, underflow to zero, too long.
    Invalid,
}

impl Ext {
    pub const ZERO: Ext = Ext { neg: false, mant: 0, exp: 0 };

    /// Parses `text` as Redis' `string2ld` does: no leading space, nothing after the number,
    /// decimal or hexadecimal (`0x1.8p3`), `inf`/`infinity`; NaN, overflow and a non-zero
    /// number that rounds to zero are invalid.
    pub fn parse(text: &[u8]) -> Parsed {
        if text.is_empty() || text.len() >= MAX_FLOAT_CHARS {
            return Parsed::Invalid;
        }
        // Redis copies the argument into a C string: strtold stops at a NUL and Redis only
        // checks that it stopped at the terminator, so "1\0x" is 1 and "\0" is 0.
        let text = &text[..text.iter().position(|&b| b == 0).unwrap_or(text.len())];
        if text.first().is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')) {
            return Parsed::Invalid;
        }
        if text.is_empty() {
            return Parsed::Finite(Ext::ZERO);
        }
        let (neg, body) = match text[0] {
            b'-' => (true, &text[1..]),
            b'+' => (false, &text[1..]),
            _ => (false, text),
        };
        let lower = body.to_ascii_lowercase();
        if lower == b"inf" || lower == b"infinity" {
            return Parsed::Infinite;
        }
        let parsed =
            if lower.len() > 2 && lower.starts_with(b"0x") { parse_hex(&lower[2..]) } else { parse_decimal(&lower) };
        match parsed {
            Some(Rounded::Value(x)) if x.mant == 0 && !x.exact_zero_input() => Parsed::Invalid,
            Some(Rounded::Value(x)) => Parsed::Finite(Ext { neg, ..x }),
            Some(Rounded::Overflow) | None => Parsed::Invalid,
        }
    }

    /// Marker kept by the parsers: a zero that came from a non-zero number (ERANGE) has
    /// `exp == 1`; a written zero has `exp == 0`.
    fn exact_zero_input(&self) -> bool {
        self.exp == 0
    }

    /// `self + other`, rounded once; `None` when it overflows to infinity.
    pub fn add(self, other: Ext) -> Option<Ext> {
        if other.mant == 0 {
            return Some(self.normal_zero());
        }
        if self.mant == 0 {
            return Some(other);
        }
        let base = self.exp.min(other.exp);
        let a = Big::from_u128(u128::from(self.mant)).shl((self.exp - base) as u64);
        let b = Big::from_u128(u128::from(other.mant)).shl((other.exp - base) as u64);
        let (neg, sum) = if self.neg == other.neg {
            (self.neg, a.add(&b))
        } else {
            match a.cmp(&b) {
                Ordering::Equal => return Some(Ext::ZERO),
                Ordering::Greater => (self.neg, a.sub(&b)),
                Ordering::Less => (other.neg, b.sub(&a)),
            }
        };
        match round(&sum, base, false) {
            Rounded::Value(x) => Some(Ext { neg, ..x }),
            Rounded::Overflow => None,
        }
    }

    fn normal_zero(self) -> Ext {
        if self.mant == 0 {
            Ext::ZERO
        } else {
            self
        }
    }

    /// The text Redis stores for an INCRBYFLOAT result: `%.17Lf`, trailing zeros (and a
    /// trailing point) removed, `-0` written `0`.
    pub fn to_human(self) -> String {
        let int_part;
        let mut frac: u128 = 0;
        if self.exp >= 0 {
            int_part = Big::from_u128(u128::from(self.mant)).shl(self.exp as u64);
        } else {
            let shift = (-self.exp) as u32;
            let (int, rest) =
                if shift >= 64 { (0u64, self.mant) } else { (self.mant >> shift, self.mant & ((1u64 << shift) - 1)) };
            // rest < 2^shift and 10^17 < 2^57: the product fits 121 bits.
            const SCALE: u128 = 100_000_000_000_000_000;
            let scaled = u128::from(rest) * SCALE;
            let mut int = int;
            if shift < 122 {
                let digits = scaled >> shift;
                let remainder = scaled & ((1u128 << shift) - 1);
                let half = 1u128 << (shift - 1);
                let up = remainder > half || (remainder == half && digits & 1 == 1);
                frac = digits + u128::from(up);
                if frac == SCALE {
                    frac = 0;
                    int += 1;
                }
            }
            int_part = Big::from_u128(u128::from(int));
        }
        let mut text = String::new();
        if self.neg {
            text.push('-');
        }
        text.push_str(&int_part.to_decimal());
        if frac != 0 {
            let digits = format!("{frac:017}");
            text.push('.');
            text.push_str(digits.trim_end_matches('0'));
        }
        if text == "-0" {
            text.remove(0);
        }
        text
    }
}

/// A rounded value or an overflow.
#[derive(Debug)]
enum Rounded {
    Value(Ext),
    Overflow,
}

/// Rounds `(n + sticky) x 2^e` (sticky: something non-zero below `n`'s last bit) to the
/// format: 64 significant bits, subnormals below 2^-16382, ties to even. A non-zero value
/// that rounds to zero comes back with `exp == 1` (the parsers' ERANGE marker).
fn round(n: &Big, e: i64, sticky: bool) -> Rounded {
    if n.is_zero() {
        let exp = i64::from(sticky);
        return Rounded::Value(Ext { neg: false, mant: 0, exp });
    }
    let bits = n.bits() as i64;
    let exp = (e + bits - MANT_BITS).max(MIN_EXP);
    let drop = exp - e;
    let (mut mant, mut exp) = if drop <= 0 {
        (n.shl((-drop) as u64).low_u128(), exp)
    } else {
        let drop = drop as u64;
        let kept = n.shr_low_u128(drop);
        let half = n.bit(drop - 1);
        let rest = sticky || n.any_below(drop - 1);
        let up = half && (rest || kept & 1 == 1);
        (kept + u128::from(up), exp)
    };
    if mant >> MANT_BITS != 0 {
        mant >>= 1;
        exp += 1;
    }
    if exp > MAX_EXP {
        return Rounded::Overflow;
    }
    let mant = mant as u64;
    if mant == 0 {
        return Rounded::Value(Ext { neg: false, mant: 0, exp: 1 });
    }
    Rounded::Value(Ext { neg: false, mant, exp })
}

/// Decimal `digits[.digits][e[+-]digits]` (lower-cased, sign removed); `None` on bad syntax.
fn parse_decimal(text: &[u8]) -> Option<Rounded> {
    let (mantissa, exponent) = match text.iter().position(|&b| b == b'e') {
        Some(i) => (&text[..i], Some(&text[i + 1..])),
        None => (text, None),
    };
    let (int_digits, frac_digits) = split_point(mantissa)?;
    if !int_digits.iter().chain(frac_digits).all(u8::is_ascii_digit) {
        return None;
    }
    let exp10 = match exponent {
        Some(e) => parse_exponent(e)?,
        None => 0,
    };
    // The significant digits and where the point goes.
    let all: Vec<u8> = int_digits.iter().chain(frac_digits).copied().collect();
    let first = all.iter().position(|&d| d != b'0');
    let Some(first) = first else {
        return Some(Rounded::Value(Ext::ZERO));
    };
    let last = all.iter().rposition(|&d| d != b'0').expect("a non-zero digit exists");
    let significant = &all[first..=last];
    // value = significant x 10^exp10, exp10 counted from the last significant digit.
    let trailing_zeros = (all.len() - 1 - last) as i64;
    let exp10 = exp10.saturating_add(trailing_zeros).saturating_sub(frac_digits.len() as i64);
    let count = significant.len() as i64;
    if count - 1 + exp10 > MAX_DECIMAL_EXP {
        return Some(Rounded::Overflow);
    }
    if count + exp10 <= MIN_DECIMAL_EXP {
        return Some(Rounded::Value(Ext { neg: false, mant: 0, exp: 1 }));
    }
    let n = Big::from_decimal(significant);
    if exp10 >= 0 {
        return Some(round(&n.mul(&Big::pow10(exp10 as u32)), 0, false));
    }
    Some(divide_and_round(n, &Big::pow10((-exp10) as u32)))
}

/// Hexadecimal `hex[.hex][p[+-]digits]` after `0x` (lower-cased); `None` on bad syntax.
fn parse_hex(text: &[u8]) -> Option<Rounded> {
    let (mantissa, exponent) = match text.iter().position(|&b| b == b'p') {
        Some(i) => (&text[..i], Some(&text[i + 1..])),
        None => (text, None),
    };
    let (int_digits, frac_digits) = split_point(mantissa)?;
    if !int_digits.iter().chain(frac_digits).all(u8::is_ascii_hexdigit) {
        return None;
    }
    let exp2 = match exponent {
        Some(e) => parse_exponent(e)?,
        None => 0,
    };
    let digits: Vec<u8> = int_digits.iter().chain(frac_digits).copied().collect();
    let n = Big::from_hex(&digits);
    if n.is_zero() {
        return Some(Rounded::Value(Ext::ZERO));
    }
    let e = exp2.saturating_sub(4 * frac_digits.len() as i64);
    let top = e.saturating_add(n.bits() as i64);
    if top > MAX_EXP + MANT_BITS {
        return Some(Rounded::Overflow);
    }
    if top < MIN_EXP - 1 {
        return Some(Rounded::Value(Ext { neg: false, mant: 0, exp: 1 }));
    }
    Some(round(&n, e, false))
}

/// Splits `int[.frac]`, requiring at least one digit on either side.
fn split_point(mantissa: &[u8]) -> Option<(&[u8], &[u8])> {
    let (int, frac) = match mantissa.iter().position(|&b| b == b'.') {
        Some(i) => (&mantissa[..i], &mantissa[i + 1..]),
        None => (mantissa, &[][..]),
    };
    (!int.is_empty() || !frac.is_empty()).then_some((int, frac))
}

/// An exponent `[+-]digits`, saturated far beyond any meaningful range.
fn parse_exponent(text: &[u8]) -> Option<i64> {
    const SATURATED: i64 = 1 << 40;
    let (neg, digits) = match text.first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut value: i64 = 0;
    for &d in digits {
        value = (value * 10 + i64::from(d - b'0')).min(SATURATED);
    }
    Some(if neg { -value } else { value })
}

/// Rounds `numerator / denominator` (both non-zero): a quotient of 66 to 68 bits by
/// restoring division, the remainder as the sticky bit.
fn divide_and_round(numerator: Big, denominator: &Big) -> Rounded {
    const QUOTIENT_BITS: i64 = 67;
    let s = numerator.bits() as i64 - denominator.bits() as i64 - QUOTIENT_BITS;
    let (mut rest, divisor) =
        if s >= 0 { (numerator, denominator.shl(s as u64)) } else { (numerator.shl((-s) as u64), denominator.clone()) };
    let mut q: u128 = 0;
    for i in (0..=QUOTIENT_BITS as u64 + 1).rev() {
        let t = divisor.shl(i);
        if rest.cmp(&t) != Ordering::Less {
            rest = rest.sub(&t);
            q |= 1 << i;
        }
    }
    round(&Big::from_u128(q), s, !rest.is_zero())
}

/// A non-negative integer, little-endian 64-bit limbs, no high zero limbs.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Big(Vec<u64>);

impl Big {
    fn from_u128(v: u128) -> Big {
        let mut b = Big(vec![v as u64, (v >> 64) as u64]);
        b.trim();
        b
    }

    fn trim(&mut self) {
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    fn is_zero(&self) -> bool {
        self.0.is_empty()
    }

    fn bits(&self) -> u64 {
        match self.0.last() {
            None => 0,
            Some(top) => 64 * (self.0.len() as u64 - 1) + u64::from(64 - top.leading_zeros()),
        }
    }

    fn bit(&self, i: u64) -> bool {
        self.0.get((i / 64) as usize).is_some_and(|limb| limb >> (i % 64) & 1 == 1)
    }

    /// Whether any of bits `0..i` is set.
    fn any_below(&self, i: u64) -> bool {
        let whole = ((i / 64) as usize).min(self.0.len());
        if self.0[..whole].iter().any(|&l| l != 0) {
            return true;
        }
        let part = i % 64;
        part != 0 && self.0.get(whole).is_some_and(|&l| l & ((1u64 << part) - 1) != 0)
    }

    fn low_u128(&self) -> u128 {
        let limb = |i: usize| u128::from(self.0.get(i).copied().unwrap_or(0));
        limb(0) | limb(1) << 64
    }

    /// `self >> n`, which must fit 128 bits.
    fn shr_low_u128(&self, n: u64) -> u128 {
        let limbs = (n / 64) as usize;
        let bits = (n % 64) as u32;
        let limb = |i: usize| u128::from(self.0.get(limbs + i).copied().unwrap_or(0));
        let wide = limb(0) | limb(1) << 64;
        let spill = if bits == 0 { 0 } else { limb(2) << (128 - bits) };
        (wide >> bits) | spill
    }

    fn shl(&self, n: u64) -> Big {
        if self.is_zero() {
            return Big(Vec::new());
        }
        let limbs = (n / 64) as usize;
        let bits = (n % 64) as u32;
        let mut out = vec![0u64; limbs];
        out.reserve(self.0.len() + 1);
        if bits == 0 {
            out.extend_from_slice(&self.0);
        } else {
            let mut carry = 0u64;
            for &l in &self.0 {
                out.push((l << bits) | carry);
                carry = l >> (64 - bits);
            }
            out.push(carry);
        }
        let mut b = Big(out);
        b.trim();
        b
    }

    fn cmp(&self, other: &Big) -> Ordering {
        self.0.len().cmp(&other.0.len()).then_with(|| self.0.iter().rev().cmp(other.0.iter().rev()))
    }

    fn add(&self, other: &Big) -> Big {
        let (long, short) = if self.0.len() >= other.0.len() { (self, other) } else { (other, self) };
        let mut out = Vec::with_capacity(long.0.len() + 1);
        let mut carry = false;
        for (i, &l) in long.0.iter().enumerate() {
            let (s, c1) = l.overflowing_add(short.0.get(i).copied().unwrap_or(0));
            let (s, c2) = s.overflowing_add(u64::from(carry));
            out.push(s);
            carry = c1 || c2;
        }
        out.push(u64::from(carry));
        let mut b = Big(out);
        b.trim();
        b
    }

    /// `self - other`; `self >= other`.
    fn sub(&self, other: &Big) -> Big {
        let mut out = Vec::with_capacity(self.0.len());
        let mut borrow = false;
        for (i, &l) in self.0.iter().enumerate() {
            let (d, b1) = l.overflowing_sub(other.0.get(i).copied().unwrap_or(0));
            let (d, b2) = d.overflowing_sub(u64::from(borrow));
            out.push(d);
            borrow = b1 || b2;
        }
        debug_assert!(!borrow, "subtracting a larger number");
        let mut b = Big(out);
        b.trim();
        b
    }

    fn mul_small(&mut self, m: u64, add: u64) {
        let mut carry = u128::from(add);
        for l in &mut self.0 {
            let p = u128::from(*l) * u128::from(m) + carry;
            *l = p as u64;
            carry = p >> 64;
        }
        if carry != 0 {
            self.0.push(carry as u64);
        }
        self.trim();
    }

    fn mul(&self, other: &Big) -> Big {
        let mut out = vec![0u64; self.0.len() + other.0.len()];
        for (i, &a) in self.0.iter().enumerate() {
            let mut carry = 0u128;
            for (j, &b) in other.0.iter().enumerate() {
                let p = u128::from(a) * u128::from(b) + u128::from(out[i + j]) + carry;
                out[i + j] = p as u64;
                carry = p >> 64;
            }
            out[i + other.0.len()] = carry as u64;
        }
        let mut b = Big(out);
        b.trim();
        b
    }

    /// Divides by `d` in place; returns the remainder.
    fn div_small(&mut self, d: u64) -> u64 {
        let mut rem = 0u128;
        for l in self.0.iter_mut().rev() {
            let cur = rem << 64 | u128::from(*l);
            *l = (cur / u128::from(d)) as u64;
            rem = cur % u128::from(d);
        }
        self.trim();
        rem as u64
    }

    fn pow10(mut n: u32) -> Big {
        const TEN_19: u64 = 10_000_000_000_000_000_000;
        let mut b = Big(vec![1]);
        while n >= 19 {
            b.mul_small(TEN_19, 0);
            n -= 19;
        }
        b.mul_small(10u64.pow(n), 0);
        b
    }

    fn from_decimal(digits: &[u8]) -> Big {
        let mut b = Big(Vec::new());
        for chunk in digits.chunks(19) {
            let value = chunk.iter().fold(0u64, |v, d| v * 10 + u64::from(d - b'0'));
            b.mul_small(10u64.pow(chunk.len() as u32), value);
        }
        b
    }

    fn from_hex(digits: &[u8]) -> Big {
        let mut b = Big(Vec::new());
        for chunk in digits.chunks(15) {
            let value = chunk.iter().fold(0u64, |v, &d| v << 4 | u64::from((d as char).to_digit(16).unwrap_or(0)));
            b.mul_small(1u64 << (4 * chunk.len()), value);
        }
        b
    }

    fn to_decimal(&self) -> String {
        const TEN_19: u64 = 10_000_000_000_000_000_000;
        if self.is_zero() {
            return "0".into();
        }
        let mut n = self.clone();
        let mut chunks = Vec::new();
        while !n.is_zero() {
            chunks.push(n.div_small(TEN_19));
        }
        let mut text = chunks.pop().expect("non-zero").to_string();
        for chunk in chunks.iter().rev() {
            text.push_str(&format!("{chunk:019}"));
        }
        text
    }
}

/// INCRBYFLOAT's step: the new text of a value holding `current` (absent: 0) after adding
/// `increment`, or Redis' error text.
pub fn increment(current: Option<&[u8]>, increment: &[u8]) -> Result<String, &'static str> {
    const NOT_A_FLOAT: &str = "ERR value is not a valid float";
    let value = match current {
        None => Parsed::Finite(Ext::ZERO),
        Some(text) => Ext::parse(text),
    };
    let value = match value {
        Parsed::Invalid => return Err(NOT_A_FLOAT),
        v => v,
    };
    let incr = match Ext::parse(increment) {
        Parsed::Invalid => return Err(NOT_A_FLOAT),
        i => i,
    };
    match (value, incr) {
        (Parsed::Finite(a), Parsed::Finite(b)) => {
            a.add(b).map(Ext::to_human).ok_or("ERR increment would produce NaN or Infinity")
        }
        _ => Err("ERR increment would produce NaN or Infinity"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incr(current: Option<&str>, by: &str) -> Result<String, &'static str> {
        increment(current.map(str::as_bytes), by.as_bytes())
    }

    fn ok(current: Option<&str>, by: &str) -> String {
        incr(current, by).unwrap_or_else(|e| panic!("{current:?} + {by}: {e}"))
    }

    /// Each expected text is what redis-server 7.0.15 (x86-64) answered.
    #[test]
    fn sums_print_as_redis_prints_them() {
        assert_eq!(ok(Some("10.50"), "0.1"), "10.6");
        assert_eq!(ok(Some("0.1"), "0.2"), "0.3");
        assert_eq!(ok(None, "1e20"), "100000000000000000000");
        assert_eq!(ok(None, "-1e-20"), "0");
        assert_eq!(ok(None, "0x1p-2"), "0.25");
        // 2^-18 = 0.000003814697265625: a tie at the 17th place, to even.
        assert_eq!(ok(None, "0.000003814697265625"), "0.00000381469726562");
        assert_eq!(ok(None, "5.0e3"), "5000");
        assert_eq!(ok(None, "1e-4940"), "0");
        assert_eq!(ok(Some("5"), "-5"), "0");
        assert_eq!(ok(Some("-3"), "1.5"), "-1.5");
        assert_eq!(ok(Some("3.0e3"), "2.0e2"), "3200");
        assert_eq!(ok(Some("1"), "0x.8"), "1.5");
        assert_eq!(ok(Some("+.5"), "5."), "5.5");
        assert!(ok(None, "1.5e300").starts_with("1500000000000000000049800109861472166362379239118673928551219718"));
        let max_double = "1.7976931348623157e308";
        let once = ok(None, max_double);
        assert!(once.starts_with("179769313486231569995921046774104434048386446944329178485314420765176628523124"));
        let twice = ok(Some(&once), max_double);
        assert!(twice.starts_with("35953862697246313999184209354820886809677289388865835697062884153035325704624"));
        assert_eq!(twice.len(), 309);
    }

    #[test]
    fn errors_are_redis_errors() {
        let invalid = Err("ERR value is not a valid float");
        let infinite = Err("ERR increment would produce NaN or Infinity");
        for bad in ["abc", " 1", "1 ", "", "1e", "1e+", ".", "+", "-", "0x", "0xg", "nan", "-nan", "1.2.3", "infin"] {
            assert_eq!(incr(None, bad), invalid, "{bad:?}");
            assert_eq!(incr(Some(bad), "1"), invalid, "stored {bad:?}");
        }
        assert_eq!(incr(None, "1e-5000"), invalid, "a non-zero number that underflows to zero");
        assert_eq!(incr(None, "1e5000"), invalid, "overflow");
        assert_eq!(incr(None, &"9".repeat(MAX_FLOAT_CHARS)), invalid, "too long");
        assert_eq!(incr(None, "inf"), infinite);
        assert_eq!(incr(Some("-Infinity"), "1"), infinite);
        assert_eq!(incr(Some("1e4932"), "1e4932"), infinite, "finite operands, infinite sum");
        assert_eq!(incr(Some("abc"), "inf"), invalid, "the stored value is checked first");
        assert_eq!(ok(None, "0e999999999999"), "0", "zero with any exponent");
        assert_eq!(ok(None, "1\0junk"), "1", "strtold stops at a NUL, as in Redis");
    }

    proptest::proptest! {
        /// Any bytes: an answer, never a panic, and work bounded by the 5 KiB cut.
        #[test]
        fn any_text_parses_or_is_refused(text in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = Ext::parse(&text);
            let _ = increment(Some(&text), b"1");
        }

        /// Number-like texts, with exponents far out of range.
        #[test]
        fn number_like_texts_never_panic(
            mantissa in "[-+]?[0-9]{0,30}(\\.[0-9]{0,30})?",
            exponent in proptest::option::of(-100_000i64..100_000),
        ) {
            let text = match exponent {
                Some(e) => format!("{mantissa}e{e}"),
                None => mantissa,
            };
            let _ = increment(Some(text.as_bytes()), text.as_bytes());
        }

        /// Integers below 2^64 are exact, and so are sums below 2^64.
        #[test]
        fn integers_are_exact(a in 0u64..(1 << 62), b in 0u64..(1 << 62)) {
            let sum = increment(Some(a.to_string().as_bytes()), b.to_string().as_bytes()).unwrap();
            proptest::prop_assert_eq!(sum, (a + b).to_string());
            let difference = increment(Some(a.to_string().as_bytes()), format!("-{b}").as_bytes()).unwrap();
            proptest::prop_assert_eq!(difference, (i128::from(a) - i128::from(b)).to_string());
        }

        /// A double's shortest text, read and printed, keeps the double's value (17
        /// places are more than a double has; only the trimming may differ).
        #[test]
        fn doubles_read_back(x in -1e15f64..1e15) {
            let text = increment(None, format!("{x}").as_bytes()).unwrap();
            proptest::prop_assert_eq!(text.parse::<f64>().unwrap(), x);
        }
    }

    #[test]
    fn round_trips_and_ties() {
        // Integers up to 2^64 are exact.
        assert_eq!(ok(None, "18446744073709551615"), "18446744073709551615");
        assert_eq!(ok(Some("18446744073709551615"), "1"), "18446744073709551616");
        // 2^64 + 1 needs 65 bits: ties to even (down).
        assert_eq!(ok(None, "18446744073709551617"), "18446744073709551616");
        assert_eq!(ok(None, "18446744073709551619"), "18446744073709551620");
        assert_eq!(ok(None, "-0"), "0");
        assert_eq!(ok(None, "0.5"), "0.5");
        assert_eq!(ok(None, "0.00000000000000001"), "0.00000000000000001");
        assert_eq!(ok(None, "0.000000000000000004"), "0");
        assert_eq!(ok(None, "0.999999999999999999"), "1");
    }
}
