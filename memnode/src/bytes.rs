//! Byte sizes as people write them in flags and config files: `1073741824`, `1GiB`, `512MiB`.

/// Parses a byte count with an optional binary unit (B, KiB, MiB, GiB, TiB; also K, M, G, T).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a byte size (try 1073741824 or 1GiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        other => return Err(format!("unknown unit {other:?} in {text:?}; use B, KiB, MiB, GiB or TiB")),
    };
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text:?} is too large"))
}

/// serde: a byte size as a number or a string with a unit.
pub mod serde_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the size as a plain number of bytes.
    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*value)
    }

    /// Reads a number of bytes, or a string such as `64 MiB`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Size {
            Number(u64),
            Text(String),
        }
        match Size::deserialize(d)? {
            Size::Number(n) => Ok(n),
            Size::Text(t) => super::parse_bytes(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2g").unwrap(), 2 << 30);
        assert!(parse_bytes("1.5GiB").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }
}
