//! One ACL user: whether it is enabled, its password hashes, the commands it may run and the
//! keys it may touch, changed by Redis' ACL rules (`on`, `>pass`, `~pattern`, `+@read`, ...)
//! and described back in Redis' `ACL LIST` form.
//!
//! Passwords are kept only as SHA-256 hashes (as Redis does), compared in constant time.

use sha2::{Digest, Sha256};

use super::catalog::{Catalog, CommandId, CommandSet};
use super::category::Categories;
use crate::glob::Pattern;

/// Most password hashes one user may hold.
pub const MAX_PASSWORDS: usize = 64;
/// Most key or channel patterns one user may hold.
pub const MAX_PATTERNS: usize = 1024;
/// Longest user name.
pub const MAX_USERNAME_BYTES: usize = 256;

/// A SHA-256 password hash.
pub type PasswordHash = [u8; 32];

/// The hash Redis keeps for `password`.
pub fn hash_password(password: &[u8]) -> PasswordHash {
    Sha256::digest(password).into()
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    bytes.iter().flat_map(|b| [DIGITS[usize::from(b >> 4)] as char, DIGITS[usize::from(b & 15)] as char]).collect()
}

/// A hash from 64 lower-case hex digits (Redis accepts no other form).
fn from_hex(text: &[u8]) -> Option<PasswordHash> {
    if text.len() != 64 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, pair) in text.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Compares without an early exit, so timing does not tell how much of a hash matched.
fn same_hash(a: &PasswordHash, b: &PasswordHash) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How a key is touched, as a command's key positions say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyAccess {
    /// The command reads the key.
    Read,
    /// The command writes the key.
    Write,
    /// The command reads and writes the key.
    ReadWrite,
}

impl KeyAccess {
    fn reads(self) -> bool {
        matches!(self, KeyAccess::Read | KeyAccess::ReadWrite)
    }

    fn writes(self) -> bool {
        matches!(self, KeyAccess::Write | KeyAccess::ReadWrite)
    }
}

#[derive(Debug, Clone)]
struct KeyPattern {
    source: Vec<u8>,
    pattern: Pattern,
    read: bool,
    write: bool,
}

impl KeyPattern {
    fn describe(&self) -> String {
        let flags = match (self.read, self.write) {
            (true, true) => "",
            (true, false) => "%R",
            (false, true) => "%W",
            (false, false) => unreachable!("a key pattern allows something"),
        };
        format!("{flags}~{}", String::from_utf8_lossy(&self.source))
    }
}

/// Why a rule was refused; the text is Redis' (after `Error in ACL SETUSER modifier '...': `).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// The rule does not parse.
    #[error("Syntax error")]
    Syntax,
    /// `+`/`-` names no known command, or `+@`/`-@` no known category.
    #[error("Unknown command or category name in ACL")]
    UnknownCommand,
    /// A `#` hash is not 64 lower-case hex digits.
    #[error("The password hash must be exactly 64 characters and contain only lowercase hexadecimal characters")]
    BadHash,
    /// `<` names a password the user does not have.
    #[error("The password you are trying to remove from the user does not exist")]
    NoSuchPassword,
    /// A selector (`(...)`, `clearselectors`): not supported.
    #[error("Selectors are not supported by racekv")]
    Selectors,
    /// The user would hold more of something (passwords, patterns) than allowed: what, and the limit.
    #[error("too many {0} for one user (at most {1})")]
    TooMany(&'static str, usize),
}

/// Why a command may not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The user may not run the command.
    Command,
    /// The argument at this position is a key the user may not touch this way.
    Key(usize),
}

/// An ACL user.
#[derive(Debug, Clone)]
pub struct User {
    name: String,
    enabled: bool,
    nopass: bool,
    passwords: Vec<PasswordHash>,
    commands: CommandSet,
    /// The command rules as given (normalized), for `ACL LIST`; empty: `-@all`.
    command_rules: Vec<String>,
    keys: Vec<KeyPattern>,
    /// Some key pattern allows reading and writing every key: no key needs checking.
    all_keys: bool,
    channels: Vec<Vec<u8>>,
}

impl User {
    /// A new user as `ACL SETUSER name` makes it: off, no password, no commands, no keys.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            enabled: false,
            nopass: false,
            passwords: Vec::new(),
            commands: CommandSet::empty(),
            command_rules: Vec::new(),
            keys: Vec::new(),
            all_keys: false,
            channels: Vec::new(),
        }
    }

    /// The built-in `default` user: `on nopass ~* &* +@all`.
    pub fn default_user(catalog: &Catalog) -> Self {
        let mut user = Self::new(super::DEFAULT_USER);
        for rule in ["on", "nopass", "~*", "&*", "+@all"] {
            user.apply(rule.as_bytes(), catalog).expect("the default user's rules are valid");
        }
        user
    }

    /// The user's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the user may run every command on every key (`on ~* +@all`, nothing taken
    /// away): who may be lent raw connections to the memnodes, which no check would
    /// stand between.
    pub fn unrestricted(&self) -> bool {
        self.enabled && self.all_keys && self.commands == CommandSet::all()
    }

    /// Whether the user may authenticate (`on`).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether any password authenticates the user (`nopass`).
    pub fn nopass(&self) -> bool {
        self.nopass
    }

    /// Whether `password` authenticates this user (enabled, and `nopass` or a matching hash).
    pub fn accepts(&self, password: &[u8]) -> bool {
        if !self.enabled {
            return false;
        }
        if self.nopass {
            return true;
        }
        let hash = hash_password(password);
        // Look at every hash, so timing does not tell which one matched.
        self.passwords.iter().fold(false, |found, h| same_hash(h, &hash) | found)
    }

    /// Whether the user may run `command` touching `keys` (argument position, key, access).
    pub fn check<'a>(
        &self,
        command: CommandId,
        keys: impl IntoIterator<Item = (usize, &'a [u8], KeyAccess)>,
    ) -> Result<(), Denial> {
        if !self.commands.contains(command) {
            return Err(Denial::Command);
        }
        if self.all_keys {
            return Ok(());
        }
        for (position, key, access) in keys {
            let allowed = self
                .keys
                .iter()
                .any(|p| (p.read || !access.reads()) && (p.write || !access.writes()) && p.pattern.matches(key));
            if !allowed {
                return Err(Denial::Key(position));
            }
        }
        Ok(())
    }

    /// Applies one rule. On error the user may be half-changed: apply rules to a copy.
    pub fn apply(&mut self, rule: &[u8], catalog: &Catalog) -> Result<(), RuleError> {
        let lower = rule.to_ascii_lowercase();
        match lower.as_slice() {
            b"on" => self.enabled = true,
            b"off" => self.enabled = false,
            b"nopass" => {
                self.nopass = true;
                self.passwords.clear();
            }
            b"resetpass" => {
                self.nopass = false;
                self.passwords.clear();
            }
            b"allkeys" => self.add_key_pattern(b"*", true, true)?,
            b"resetkeys" => {
                self.keys.clear();
                self.all_keys = false;
            }
            b"allchannels" => self.channels = vec![b"*".to_vec()],
            b"resetchannels" => self.channels.clear(),
            b"allcommands" => self.allow_all(true),
            b"nocommands" => self.allow_all(false),
            b"clearselectors" => {}
            b"reset" => {
                for rule in ["resetpass", "resetkeys", "resetchannels", "off", "-@all"] {
                    self.apply(rule.as_bytes(), catalog)?;
                }
            }
            _ => return self.apply_prefixed(rule, catalog),
        }
        Ok(())
    }

    fn apply_prefixed(&mut self, rule: &[u8], catalog: &Catalog) -> Result<(), RuleError> {
        let (&first, rest) = rule.split_first().ok_or(RuleError::Syntax)?;
        match first {
            b'>' => {
                self.add_password(hash_password(rest))?;
            }
            b'#' => {
                self.add_password(from_hex(rest).ok_or(RuleError::BadHash)?)?;
            }
            b'<' => self.remove_password(&hash_password(rest))?,
            b'!' => self.remove_password(&from_hex(rest).ok_or(RuleError::BadHash)?)?,
            b'~' => self.add_key_pattern(rest, true, true)?,
            b'%' => {
                let tilde = rest.iter().position(|&b| b == b'~').ok_or(RuleError::Syntax)?;
                let (flags, pattern) = (&rest[..tilde], &rest[tilde + 1..]);
                let (mut read, mut write) = (false, false);
                for flag in flags {
                    match flag.to_ascii_uppercase() {
                        b'R' => read = true,
                        b'W' => write = true,
                        _ => return Err(RuleError::Syntax),
                    }
                }
                if !read && !write {
                    return Err(RuleError::Syntax);
                }
                self.add_key_pattern(pattern, read, write)?;
            }
            b'&' => {
                if self.channels.len() >= MAX_PATTERNS {
                    return Err(RuleError::TooMany("channel patterns", MAX_PATTERNS));
                }
                if !self.channels.iter().any(|c| c == rest) {
                    self.channels.push(rest.to_vec());
                }
            }
            b'+' | b'-' => self.command_rule(first == b'+', rest, catalog)?,
            b'(' => return Err(RuleError::Selectors),
            _ => return Err(RuleError::Syntax),
        }
        Ok(())
    }

    fn add_password(&mut self, hash: PasswordHash) -> Result<(), RuleError> {
        self.nopass = false;
        if self.passwords.iter().any(|h| same_hash(h, &hash)) {
            return Ok(());
        }
        if self.passwords.len() >= MAX_PASSWORDS {
            return Err(RuleError::TooMany("passwords", MAX_PASSWORDS));
        }
        self.passwords.push(hash);
        Ok(())
    }

    fn remove_password(&mut self, hash: &PasswordHash) -> Result<(), RuleError> {
        let before = self.passwords.len();
        self.passwords.retain(|h| !same_hash(h, hash));
        if self.passwords.len() == before {
            return Err(RuleError::NoSuchPassword);
        }
        Ok(())
    }

    fn add_key_pattern(&mut self, pattern: &[u8], read: bool, write: bool) -> Result<(), RuleError> {
        if let Some(existing) = self.keys.iter_mut().find(|k| k.source == pattern) {
            existing.read |= read;
            existing.write |= write;
        } else {
            if self.keys.len() >= MAX_PATTERNS {
                return Err(RuleError::TooMany("key patterns", MAX_PATTERNS));
            }
            let compiled = Pattern::new(pattern, false);
            self.keys.push(KeyPattern { source: pattern.to_vec(), pattern: compiled, read, write });
        }
        self.all_keys = self.keys.iter().any(|k| k.read && k.write && k.pattern.matches_all());
        Ok(())
    }

    fn allow_all(&mut self, allowed: bool) {
        self.commands = if allowed { CommandSet::all() } else { CommandSet::empty() };
        self.command_rules = if allowed { vec!["+@all".into()] } else { Vec::new() };
    }

    /// `+name`, `-name`, `+@category`, `-@category`, `+container|sub`.
    fn command_rule(&mut self, allow: bool, target: &[u8], catalog: &Catalog) -> Result<(), RuleError> {
        let target = target.to_ascii_lowercase();
        if let Some(category) = target.strip_prefix(b"@") {
            if category == b"all" {
                self.allow_all(allow);
                return Ok(());
            }
            let category = Categories::by_name(category).ok_or(RuleError::UnknownCommand)?;
            for id in catalog.in_category(category) {
                self.commands.set(id, allow);
            }
        } else {
            let id = catalog.lookup(&target).ok_or(RuleError::UnknownCommand)?;
            let ids: Vec<CommandId> = catalog.family(id).collect();
            for id in ids {
                self.commands.set(id, allow);
            }
        }
        let text = String::from_utf8_lossy(&target).into_owned();
        self.command_rules.retain(|r| r[1..] != text);
        self.command_rules.push(format!("{}{text}", if allow { '+' } else { '-' }));
        Ok(())
    }

    /// The flags `ACL GETUSER` lists.
    pub fn flags(&self) -> Vec<&'static str> {
        let mut flags = vec![if self.enabled { "on" } else { "off" }];
        if self.nopass {
            flags.push("nopass");
        }
        flags
    }

    /// The password hashes: what a password-keyed handshake proves (`transport::auth`).
    pub fn password_keys(&self) -> Vec<Vec<u8>> {
        self.passwords.iter().map(|h| h.to_vec()).collect()
    }

    /// The password hashes, as hex.
    pub fn password_hashes(&self) -> Vec<String> {
        self.passwords.iter().map(|h| to_hex(h)).collect()
    }

    /// The command rules (`+@all`, `-@all +get`, ...).
    pub fn describe_commands(&self) -> String {
        match self.command_rules.first() {
            None => "-@all".into(),
            Some(first) if first == "+@all" => self.command_rules.join(" "),
            Some(_) => format!("-@all {}", self.command_rules.join(" ")),
        }
    }

    /// The key patterns (`~*`, `%R~cache:*`, ...), space separated; empty when none.
    pub fn describe_keys(&self) -> String {
        self.keys.iter().map(KeyPattern::describe).collect::<Vec<_>>().join(" ")
    }

    /// The channel patterns (`&*`), space separated; empty when none.
    pub fn describe_channels(&self) -> String {
        self.channels.iter().map(|c| format!("&{}", String::from_utf8_lossy(c))).collect::<Vec<_>>().join(" ")
    }

    /// The user as an `ACL LIST` line (also the ACL file's format): applying the rules after
    /// `user <name>` to a new user gives this user back.
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("user {}", self.name)];
        parts.extend(self.flags().into_iter().map(String::from));
        parts.extend(self.passwords.iter().map(|h| format!("#{}", to_hex(h))));
        if !self.keys.is_empty() {
            parts.push(self.describe_keys());
        }
        if self.channels.is_empty() {
            parts.push("resetchannels".into());
        } else {
            parts.push(self.describe_channels());
        }
        parts.push(self.describe_commands());
        parts.join(" ")
    }
}

/// Whether `name` can be a user name: not empty, bounded, no spaces or control bytes (it is
/// written in ACL files and lists, space separated).
pub fn valid_username(name: &[u8]) -> bool {
    !name.is_empty() && name.len() <= MAX_USERNAME_BYTES && name.iter().all(|&b| b > b' ' && b != 0x7f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Catalog {
        let mut c = Catalog::new();
        c.add("get", Categories::READ.and(Categories::STRING).and(Categories::FAST), None);
        c.add("set", Categories::WRITE.and(Categories::STRING).and(Categories::SLOW), None);
        let config = c.add("config", Categories::SLOW, None);
        c.add("get", Categories::ADMIN.and(Categories::SLOW).and(Categories::DANGEROUS), Some(config));
        c.add("set", Categories::ADMIN.and(Categories::SLOW).and(Categories::DANGEROUS), Some(config));
        c
    }

    fn user(rules: &str) -> User {
        let c = catalog();
        let mut u = User::new("alice");
        for rule in rules.split_whitespace() {
            u.apply(rule.as_bytes(), &c).unwrap();
        }
        u
    }

    fn id(name: &str) -> CommandId {
        catalog().lookup(name.as_bytes()).unwrap()
    }

    #[test]
    fn new_users_are_off_and_may_do_nothing() {
        let u = User::new("bob");
        assert!(!u.accepts(b""));
        assert_eq!(u.check(id("get"), []), Err(Denial::Command));
        assert_eq!(u.describe(), "user bob off resetchannels -@all");
    }

    #[test]
    fn passwords_are_hashed_added_and_removed() {
        let mut u = user("on >secret >other");
        assert!(u.accepts(b"secret") && u.accepts(b"other") && !u.accepts(b"nope"));
        let c = catalog();
        u.apply(b"<secret", &c).unwrap();
        assert!(!u.accepts(b"secret"));
        assert_eq!(u.apply(b"<secret", &c), Err(RuleError::NoSuchPassword));
        let hash = to_hex(&hash_password(b"third"));
        u.apply(format!("#{hash}").as_bytes(), &c).unwrap();
        assert!(u.accepts(b"third"));
        assert_eq!(u.apply(b"#ABC", &c), Err(RuleError::BadHash));
        assert_eq!(u.apply(format!("#{}", hash.to_uppercase()).as_bytes(), &c), Err(RuleError::BadHash));
        u.apply(b"off", &c).unwrap();
        assert!(!u.accepts(b"third"), "a disabled user never authenticates");
        u.apply(b"on", &c).unwrap();
        u.apply(b"nopass", &c).unwrap();
        assert!(u.accepts(b"anything") && u.password_hashes().is_empty());
        u.apply(b"resetpass", &c).unwrap();
        assert!(!u.accepts(b"anything"));
    }

    #[test]
    fn commands_by_name_category_and_subcommand() {
        let u = user("+@read ~*");
        assert!(u.check(id("get"), []).is_ok());
        assert_eq!(u.check(id("set"), []), Err(Denial::Command));
        let u = user("+@all -set ~*");
        assert!(u.check(id("get"), []).is_ok());
        assert_eq!(u.check(id("set"), []), Err(Denial::Command));
        assert_eq!(u.describe_commands(), "+@all -set");
        let u = user("+config|get ~*");
        assert!(u.check(id("config|get"), []).is_ok());
        assert_eq!(u.check(id("config|set"), []), Err(Denial::Command));
        assert_eq!(u.describe_commands(), "-@all +config|get");
        let u = user("+config -config|set");
        assert!(u.check(id("config|get"), []).is_ok() && u.check(id("config|set"), []).is_err());
        let u = user("+get +set -get");
        assert_eq!(u.describe_commands(), "-@all +set -get", "a repeated target keeps its last rule");
        let mut u = user("");
        assert_eq!(u.apply(b"+nosuch", &catalog()), Err(RuleError::UnknownCommand));
        assert_eq!(u.apply(b"+@nosuch", &catalog()), Err(RuleError::UnknownCommand));
        assert_eq!(u.apply(b"bogus", &catalog()), Err(RuleError::Syntax));
        assert_eq!(u.apply(b"(+get)", &catalog()), Err(RuleError::Selectors));
    }

    #[test]
    fn key_patterns_with_read_and_write_permissions() {
        let u = user("+@all ~cache:* %R~ro:* %W~wo:*");
        let get = id("get");
        assert!(u.check(get, [(1, &b"cache:1"[..], KeyAccess::Read)]).is_ok());
        assert!(u.check(get, [(1, &b"ro:1"[..], KeyAccess::Read)]).is_ok());
        assert_eq!(u.check(get, [(1, &b"ro:1"[..], KeyAccess::Write)]), Err(Denial::Key(1)));
        assert_eq!(u.check(get, [(2, &b"wo:1"[..], KeyAccess::Read)]), Err(Denial::Key(2)));
        assert!(u.check(get, [(1, &b"wo:1"[..], KeyAccess::Write)]).is_ok());
        assert_eq!(u.check(get, [(1, &b"ro:1"[..], KeyAccess::ReadWrite)]), Err(Denial::Key(1)));
        assert_eq!(u.check(get, [(1, &b"other"[..], KeyAccess::Read)]), Err(Denial::Key(1)));
        assert_eq!(u.describe_keys(), "~cache:* %R~ro:* %W~wo:*");
        let u = user("+@all %R~x %W~x");
        assert_eq!(u.describe_keys(), "~x", "R and W on one pattern merge");
        let u = user("+@all allkeys");
        assert!(u.check(get, [(1, &b"anything"[..], KeyAccess::ReadWrite)]).is_ok());
        let u = user("+@all allkeys resetkeys");
        assert!(u.check(get, [(1, &b"anything"[..], KeyAccess::Read)]).is_err());
    }

    #[test]
    fn describe_round_trips_through_the_rules() {
        let c = catalog();
        let mut u = User::default_user(&c);
        assert_eq!(u.describe(), "user default on nopass ~* &* +@all");
        u = user("on >pw %R~a:* ~b &chan +@all -config|set");
        let line = u.describe();
        let mut again = User::new("alice");
        for rule in line.split_whitespace().skip(2) {
            again.apply(rule.as_bytes(), &c).unwrap();
        }
        assert_eq!(again.describe(), line);
        assert!(again.accepts(b"pw"));
        u.apply(b"reset", &c).unwrap();
        assert_eq!(u.describe(), "user alice off resetchannels -@all");
    }

    #[test]
    fn limits_are_enforced() {
        let c = catalog();
        let mut u = User::new("x");
        for i in 0..MAX_PATTERNS {
            u.apply(format!("~k{i}").as_bytes(), &c).unwrap();
        }
        assert_eq!(u.apply(b"~one-more", &c), Err(RuleError::TooMany("key patterns", MAX_PATTERNS)));
        for i in 0..MAX_PASSWORDS {
            u.apply(format!(">p{i}").as_bytes(), &c).unwrap();
        }
        assert!(u.apply(b">one-more", &c).is_err());
        assert!(valid_username(b"alice") && !valid_username(b"") && !valid_username(b"a b"));
        assert!(!valid_username(&[b'a'; MAX_USERNAME_BYTES + 1]));
    }
}
