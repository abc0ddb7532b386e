//! Secrets in configuration: read from files, never printed.
//!
//! **Reading.** [`crate::load_config`] accepts, for any text setting `X` of the daemon's config
//! struct, a key `X_file` (in the TOML file, or `<PREFIX>_X_FILE` in the environment) naming
//! a file that holds the value: the file is read (at most [`MAX_SECRET_FILE_BYTES`], UTF-8),
//! one trailing newline is stripped, and the text becomes `X`. So a secret need not sit in
//! argv (`ps`) or the environment (`/proc/<pid>/environ`): `token_file =
//! "/run/secrets/racekv-token"`. The struct declares only `X`; `X_file` never reaches serde,
//! so `#[serde(deny_unknown_fields)]` structs need no change. The rules:
//! * `X_file` applies when the struct has a field `X` whose default is text or unset
//!   (`String`, `Option<String>`, [`Secret`]) and no field named `X_file` itself (a struct's
//!   own `data_file` stays a plain path). Otherwise `X_file` is left alone, and a
//!   `deny_unknown_fields` struct rejects it as an unknown field.
//! * An empty `X_file` counts as unset. `X_file` and `X` both set (in the file or the
//!   environment; the struct's default does not count) is an error.
//! * Errors name the key and the path, never the file's content.
//!
//! Command-line flags a daemon applies after `load_config` still override `X`.
//!
//! **Printing.** [`redacted_toml`] renders a config as TOML with the named keys shown as
//! [`MASK`]; [`Secret`] is a string whose `Debug` and `Display` show only [`MASK`], so a
//! config struct logged with `{:?}` does not leak it. `Secret` serializes and deserializes as
//! the plain string (configuration layering serializes the defaults), so printing a config
//! goes through [`redacted_toml`].

use std::io::Read;
use std::path::Path;

use anyhow::Context;
use config::{Map, Value, ValueKind};
use serde::{Deserialize, Serialize};

/// Largest secret file read, in bytes (a token or a PEM key fits many times over).
pub const MAX_SECRET_FILE_BYTES: u64 = 64 * 1024;
/// The key suffix that names a file holding a setting's value.
pub const FILE_SUFFIX: &str = "_file";
/// What a secret prints as.
pub const MASK: &str = "***";

/// A string that must not be logged: `Debug` and `Display` print [`MASK`].
///
/// Serde sees the plain string (so it layers and parses like a `String`); use
/// [`redacted_toml`] to print a config that holds one.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that needs it (an authentication exchange).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the secret is the empty string.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_string())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

/// Reads the secret for setting `key` from `path`: at most [`MAX_SECRET_FILE_BYTES`] of
/// UTF-8, one trailing newline (`\n` or `\r\n`) stripped, not empty. Errors name `key` and
/// `path`, never the content.
pub fn read_secret_file(key: &str, path: &Path) -> anyhow::Result<String> {
    let shown = path.display();
    let file = std::fs::File::open(path).with_context(|| format!("opening {key}'s file {shown}"))?;
    // `take` bounds the read even when the length on disk lies (a pipe, a /proc file).
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {key}'s file {shown}"))?;
    anyhow::ensure!(
        bytes.len() as u64 <= MAX_SECRET_FILE_BYTES,
        "{key}'s file {shown} is larger than {MAX_SECRET_FILE_BYTES} bytes"
    );
    let Ok(mut text) = String::from_utf8(bytes) else {
        anyhow::bail!("{key}'s file {shown} is not UTF-8 text");
    };
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    anyhow::ensure!(!text.is_empty(), "{key}'s file {shown} is empty");
    Ok(text)
}

/// Replaces every `X_file` key that `user` (the file and environment layers) set by `X`,
/// read from that file, in `merged` (all layers). `defaults` is the struct's default tree,
/// which decides which keys are settings; `prefix` is the dotted path so far.
pub(crate) fn resolve_files(
    defaults: &Map<String, Value>,
    user: &Map<String, Value>,
    merged: &mut Map<String, Value>,
    prefix: &str,
) -> anyhow::Result<()> {
    for (key, value) in user {
        let dotted = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        if let ValueKind::Table(user_table) = &value.kind {
            let default_table = match defaults.get(key).map(|v| &v.kind) {
                Some(ValueKind::Table(t)) => Some(t),
                _ => None,
            };
            let merged_table = match merged.get_mut(key).map(|v| &mut v.kind) {
                Some(ValueKind::Table(t)) => Some(t),
                _ => None,
            };
            if let (Some(default_table), Some(merged_table)) = (default_table, merged_table) {
                resolve_files(default_table, user_table, merged_table, &dotted)?;
            }
            continue;
        }
        let Some(base) = key.strip_suffix(FILE_SUFFIX).filter(|b| !b.is_empty()) else { continue };
        if defaults.contains_key(key) {
            continue; // The struct's own `X_file` field.
        }
        let Some(default) = defaults.get(base) else { continue };
        let base_dotted = if prefix.is_empty() { base.to_string() } else { format!("{prefix}.{base}") };
        anyhow::ensure!(
            matches!(default.kind, ValueKind::String(_) | ValueKind::Nil),
            "{dotted} is set, but {base_dotted} is not a text setting"
        );
        let path = value.clone().into_string().with_context(|| format!("{dotted} must be a path"))?;
        merged.remove(key);
        if path.is_empty() {
            continue;
        }
        anyhow::ensure!(!user.contains_key(base), "both {base_dotted} and {dotted} are set: set one of them");
        let secret = read_secret_file(&base_dotted, Path::new(&path))?;
        merged.insert(base.to_string(), Value::new(Some(&path), ValueKind::String(secret)));
    }
    Ok(())
}

/// Renders `value` as TOML, every key named in `secret_keys` (at any depth, in tables and
/// arrays of tables) shown as `"***"`. Unset (`None`) settings are left out, as TOML has no
/// null.
pub fn redacted_toml<T: Serialize>(value: &T, secret_keys: &[&str]) -> anyhow::Result<String> {
    let mut table = toml::Table::try_from(value).context("rendering the configuration as TOML")?;
    mask_table(&mut table, secret_keys);
    toml::to_string_pretty(&table).context("rendering the configuration as TOML")
}

fn mask_table(table: &mut toml::Table, secret_keys: &[&str]) {
    for (key, value) in table.iter_mut() {
        if secret_keys.contains(&key.as_str()) {
            *value = toml::Value::String(MASK.to_string());
        } else {
            mask_value(value, secret_keys);
        }
    }
}

fn mask_value(value: &mut toml::Value, secret_keys: &[&str]) {
    match value {
        toml::Value::Table(table) => mask_table(table, secret_keys),
        toml::Value::Array(items) => items.iter_mut().for_each(|item| mask_value(item, secret_keys)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    const SECRET: &str = "s3cr3t-do-not-print";

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Cfg {
        token: String,
        password: Option<String>,
        key: Secret,
        data_file: Option<PathBuf>,
        port: u16,
        tls: Tls,
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Tls {
        key_password: String,
    }

    impl Default for Tls {
        fn default() -> Self {
            Self { key_password: "default-key-password".into() }
        }
    }

    impl Default for Cfg {
        fn default() -> Self {
            Self {
                token: "dev-token".into(),
                password: None,
                key: Secret::new("dev-key"),
                data_file: None,
                port: 7,
                tls: Tls::default(),
            }
        }
    }

    fn load(dir: &Path, toml: &str) -> anyhow::Result<Cfg> {
        let file = dir.join("cfg.toml");
        std::fs::write(&file, toml).unwrap();
        crate::load_config(Some(&file), "RACEKV_TELEMETRY_SECRET_TEST_NONE")
    }

    fn secret_file(dir: &Path, name: &str, content: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    fn error_text(e: &anyhow::Error) -> String {
        format!("{e:#}")
    }

    #[test]
    fn x_file_reads_the_value_and_strips_one_newline() {
        let dir = tempfile::tempdir().unwrap();
        let token = secret_file(dir.path(), "token", &format!("{SECRET}\n"));
        let password = secret_file(dir.path(), "password", &format!("{SECRET}\r\n"));
        let key = secret_file(dir.path(), "key", &format!("{SECRET}\n\n"));
        let tls = secret_file(dir.path(), "tls", SECRET);
        let cfg = load(
            dir.path(),
            &format!(
                "token_file = {:?}\npassword_file = {:?}\nkey_file = {:?}\n[tls]\nkey_password_file = {:?}\n",
                token.display().to_string(),
                password.display().to_string(),
                key.display().to_string(),
                tls.display().to_string()
            ),
        )
        .unwrap();
        assert_eq!(cfg.token, SECRET);
        assert_eq!(cfg.password.as_deref(), Some(SECRET));
        assert_eq!(cfg.key.expose(), format!("{SECRET}\n"), "only one trailing newline is stripped");
        assert_eq!(cfg.tls.key_password, SECRET);
        assert_eq!(cfg.port, 7, "other keys keep their defaults");
        assert_eq!(cfg.data_file, None);
    }

    #[test]
    fn x_file_works_from_the_environment_and_clashes_with_x_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let token = secret_file(dir.path(), "token", &format!("{SECRET}\n"));
        // A prefix no other test uses: this variable is this test's alone.
        let prefix = "RACEKV_TELEMETRY_SECRET_ENV_TEST";
        std::env::set_var(format!("{prefix}_TOKEN_FILE"), &token);
        std::env::set_var(format!("{prefix}_TLS__KEY_PASSWORD_FILE"), &token);
        let cfg: Cfg = crate::load_config(None, prefix).unwrap();
        assert_eq!(cfg.token, SECRET);
        assert_eq!(cfg.tls.key_password, SECRET);
        let file = dir.path().join("cfg.toml");
        std::fs::write(&file, "token = \"inline\"\n").unwrap();
        let e = crate::load_config::<Cfg>(Some(&file), prefix).unwrap_err();
        let text = error_text(&e);
        std::env::remove_var(format!("{prefix}_TOKEN_FILE"));
        std::env::remove_var(format!("{prefix}_TLS__KEY_PASSWORD_FILE"));
        assert!(text.contains("both token and token_file are set") && !text.contains(SECRET), "{text}");
    }

    #[test]
    fn a_structs_own_x_file_field_stays_a_path() {
        let dir = tempfile::tempdir().unwrap();
        let data = secret_file(dir.path(), "data", SECRET);
        let cfg = load(dir.path(), &format!("data_file = {:?}\n", data.display().to_string())).unwrap();
        assert_eq!(cfg.data_file.as_deref(), Some(data.as_path()));
    }

    #[test]
    fn an_empty_x_file_is_unset() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = load(dir.path(), "token_file = \"\"\n").unwrap();
        assert_eq!(cfg.token, "dev-token");
    }

    #[test]
    fn x_and_x_file_both_set_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let token = secret_file(dir.path(), "token", SECRET);
        let e = load(dir.path(), &format!("token = \"inline\"\ntoken_file = {:?}\n", token.display().to_string()))
            .unwrap_err();
        let text = error_text(&e);
        assert!(text.contains("both token and token_file are set"), "{text}");
        assert!(!text.contains(SECRET), "{text}");
    }

    #[test]
    fn file_errors_name_key_and_path_but_not_content() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let e = load(dir.path(), &format!("token_file = {:?}\n", missing.display().to_string())).unwrap_err();
        let text = error_text(&e);
        assert!(text.contains("token") && text.contains(&missing.display().to_string()), "{text}");

        let big = secret_file(dir.path(), "big", &SECRET.repeat(MAX_SECRET_FILE_BYTES as usize / SECRET.len() + 1));
        let e = load(dir.path(), &format!("token_file = {:?}\n", big.display().to_string())).unwrap_err();
        let text = error_text(&e);
        assert!(text.contains("larger than") && !text.contains(SECRET), "{text}");

        let binary = dir.path().join("binary");
        std::fs::write(&binary, [b's', 0xff, 0xfe, b'x']).unwrap();
        let e = load(dir.path(), &format!("token_file = {:?}\n", binary.display().to_string())).unwrap_err();
        assert!(error_text(&e).contains("not UTF-8"), "{}", error_text(&e));

        let empty = secret_file(dir.path(), "empty", "\n");
        let e = load(dir.path(), &format!("token_file = {:?}\n", empty.display().to_string())).unwrap_err();
        assert!(error_text(&e).contains("is empty"), "{}", error_text(&e));
    }

    #[test]
    fn x_file_for_a_non_text_or_unknown_setting_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let port = secret_file(dir.path(), "port", "80");
        let e = load(dir.path(), &format!("port_file = {:?}\n", port.display().to_string())).unwrap_err();
        assert!(error_text(&e).contains("not a text setting"), "{}", error_text(&e));
        let e = load(dir.path(), &format!("nothing_file = {:?}\n", port.display().to_string())).unwrap_err();
        assert!(error_text(&e).contains("nothing_file"), "{}", error_text(&e));
    }

    #[test]
    fn redacted_toml_masks_secrets_and_parses_back() {
        let cfg = Cfg {
            token: SECRET.into(),
            password: Some(SECRET.into()),
            key: Secret::new(SECRET),
            data_file: Some("/var/lib/racekv/region".into()),
            port: 9,
            tls: Tls { key_password: SECRET.into() },
        };
        let text = redacted_toml(&cfg, &["token", "password", "key", "key_password"]).unwrap();
        assert!(!text.contains(SECRET), "{text}");
        let parsed: toml::Table = text.parse().unwrap();
        assert_eq!(parsed["token"].as_str(), Some(MASK));
        assert_eq!(parsed["password"].as_str(), Some(MASK));
        assert_eq!(parsed["key"].as_str(), Some(MASK));
        assert_eq!(parsed["tls"]["key_password"].as_str(), Some(MASK));
        assert_eq!(parsed["port"].as_integer(), Some(9));
        assert_eq!(parsed["data_file"].as_str(), Some("/var/lib/racekv/region"));
        // Unmasked, the same struct round-trips through TOML (the printed form is valid).
        let plain: Cfg = toml::from_str(&redacted_toml(&cfg, &[]).unwrap()).unwrap();
        assert_eq!(plain, cfg);
    }

    #[test]
    fn secret_debug_and_display_are_masked() {
        let cfg = Cfg { key: Secret::new(SECRET), ..Cfg::default() };
        assert!(!format!("{cfg:?}").contains(SECRET));
        assert_eq!(format!("{}", cfg.key), MASK);
        assert_eq!(format!("{:?}", cfg.key), MASK);
        assert_eq!(cfg.key.expose(), SECRET);
    }
}
