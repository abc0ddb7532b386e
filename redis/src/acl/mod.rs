//! Access control as Redis 7 has it: users with hashed passwords, command and category
//! permissions and key patterns ([`user`]), `requirepass` for the `default` user, and an ACL
//! file (`ACL LOAD` / `ACL SAVE`).
//!
//! [`Acl`] is shared by every connection of a server (and by the computenode's other front
//! ends). Connections hold an `Arc<User>` and look it up again only when the ACL's
//! generation changes, so checking a command costs one atomic load plus a bit test (and the
//! key patterns, for users restricted to some keys).

pub mod catalog;
pub mod category;
pub mod user;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

pub use catalog::{Catalog, CommandId};
pub use category::Categories;
pub use user::{Denial, KeyAccess, RuleError, User};

/// The user every connection starts as.
pub const DEFAULT_USER: &str = "default";
/// Most users an ACL holds.
pub const MAX_USERS: usize = 10_000;
/// Largest ACL file read.
pub const MAX_ACL_FILE_BYTES: u64 = 16 << 20;

/// How an ACL starts.
#[derive(Debug, Clone, Default)]
pub struct AclOptions {
    /// The `default` user's password (Redis' `requirepass`); `None` leaves it as the ACL
    /// file has it (or `nopass`).
    pub requirepass: Option<String>,
    /// The ACL file (`aclfile`): read at start, by `ACL LOAD`, written by `ACL SAVE`.
    pub file: Option<PathBuf>,
}

/// Why an ACL operation failed; the texts are Redis' where Redis has one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AclError {
    /// A rule of ACL SETUSER (or of the ACL file) was refused.
    #[error("Error in ACL SETUSER modifier '{rule}': {reason}")]
    Rule {
        /// The rule as written.
        rule: String,
        /// Why it was refused.
        reason: RuleError,
    },
    /// The user name is empty, too long, or holds a space or a NUL.
    #[error(
        "Usernames can't contain spaces or null characters, nor be empty or longer than {} bytes",
        user::MAX_USERNAME_BYTES
    )]
    BadUsername,
    /// An attempt to remove the `default` user.
    #[error("The 'default' user cannot be removed")]
    DefaultUser,
    /// Creating the user would pass [`MAX_USERS`].
    #[error("too many ACL users (at most {MAX_USERS})")]
    TooManyUsers,
    /// ACL LOAD or ACL SAVE without a configured ACL file.
    #[error("This Redis instance is not configured to use an ACL file. You may want to specify users via the ACL SETUSER command and then issue a CONFIG REWRITE (assuming you have a Redis configuration file set) in order to store users in the Redis configuration.")]
    NoFile,
    /// Reading, writing or parsing the ACL file failed.
    #[error("{0}")]
    File(String),
}

/// Why authentication failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No such user, disabled, or a wrong password (told apart only in logs, never to the
    /// client).
    WrongPass,
    /// `AUTH password` while the default user has no password.
    NoDefaultPassword,
}

/// The users of a server.
pub struct Acl {
    catalog: Arc<Catalog>,
    users: RwLock<BTreeMap<String, Arc<User>>>,
    /// Bumped on every change, so connections know to look their user up again.
    generation: AtomicU64,
    options: AclOptions,
}

impl std::fmt::Debug for Acl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acl").field("users", &self.users.read().len()).field("file", &self.options.file).finish()
    }
}

impl Acl {
    /// The ACL `options` describe: the file's users (if any), then `requirepass`.
    pub fn new(catalog: Arc<Catalog>, options: AclOptions) -> Result<Self, AclError> {
        let acl = Self { catalog, users: RwLock::new(BTreeMap::new()), generation: AtomicU64::new(0), options };
        let users = match &acl.options.file {
            Some(path) if path.exists() => acl.parse_file(path)?,
            _ => acl.with_default(BTreeMap::new()),
        };
        *acl.users.write() = users;
        if let Some(password) = acl.options.requirepass.clone() {
            acl.set_user(DEFAULT_USER.as_bytes(), &[b"resetpass", format!(">{password}").as_bytes()])?;
        }
        Ok(acl)
    }

    /// An ACL with only the open `default` user (no password, everything allowed).
    pub fn open(catalog: Arc<Catalog>) -> Self {
        Self::new(catalog, AclOptions::default()).expect("no file, no password: nothing can fail")
    }

    /// The command catalog the rules name.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// Changes whenever a user changes.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The user named `name`.
    pub fn user(&self, name: &str) -> Option<Arc<User>> {
        self.users.read().get(name).cloned()
    }

    /// The user a new connection is, before any AUTH: `default` when it is enabled and
    /// needs no password; otherwise none (the connection must authenticate).
    pub fn initial_user(&self) -> Option<Arc<User>> {
        self.user(DEFAULT_USER).filter(|u| u.enabled() && u.nopass())
    }

    /// Whether anyone can connect without a password (what protected mode looks at).
    pub fn is_open(&self) -> bool {
        self.initial_user().is_some()
    }

    /// Checks `password` for `username` (`None`: Redis' one-argument `AUTH`, the default
    /// user).
    pub fn authenticate(&self, username: Option<&[u8]>, password: &[u8]) -> Result<Arc<User>, AuthFailure> {
        let name = match username {
            Some(name) => std::str::from_utf8(name).map_err(|_| AuthFailure::WrongPass)?,
            None => {
                if self.initial_user().is_some() {
                    return Err(AuthFailure::NoDefaultPassword);
                }
                DEFAULT_USER
            }
        };
        let user = self.user(name).ok_or(AuthFailure::WrongPass)?;
        if user.accepts(password) {
            Ok(user)
        } else {
            Err(AuthFailure::WrongPass)
        }
    }

    /// Whether `user` may run `command` (a name in the catalog, `get`, `config|get`) on
    /// `keys`; the error is Redis' NOPERM text. For front ends other than RESP that map their
    /// operations onto Redis commands.
    pub fn check<'a>(
        &self,
        user: &str,
        command: &str,
        keys: impl IntoIterator<Item = (&'a [u8], KeyAccess)>,
    ) -> Result<(), String> {
        let Some(id) = self.catalog.lookup(command.as_bytes()) else {
            return Err(format!("NOPERM unknown command '{command}'"));
        };
        let Some(found) = self.user(user) else {
            return Err(format!("NOPERM user {user} no longer exists"));
        };
        found.check(id, keys.into_iter().enumerate().map(|(i, (key, access))| (i + 1, key, access))).map_err(|denial| {
            match denial {
                Denial::Command => format!("NOPERM User {user} has no permissions to run the '{command}' command"),
                Denial::Key(_) => "NOPERM No permissions to access a key".to_string(),
            }
        })
    }

    /// `ACL SETUSER name rule...`: creates the user if needed and applies the rules, all or
    /// nothing.
    pub fn set_user(&self, name: &[u8], rules: &[&[u8]]) -> Result<(), AclError> {
        if !user::valid_username(name) {
            return Err(AclError::BadUsername);
        }
        let name = std::str::from_utf8(name).map_err(|_| AclError::BadUsername)?;
        let mut users = self.users.write();
        let mut changed = match users.get(name) {
            Some(existing) => User::clone(existing),
            None if users.len() >= MAX_USERS => return Err(AclError::TooManyUsers),
            None => User::new(name),
        };
        apply_rules(&mut changed, rules, &self.catalog)?;
        users.insert(name.to_string(), Arc::new(changed));
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// `ACL DELUSER name...`: how many existed. The default user cannot be removed.
    pub fn delete_users(&self, names: &[&[u8]]) -> Result<usize, AclError> {
        if names.iter().any(|n| *n == DEFAULT_USER.as_bytes()) {
            return Err(AclError::DefaultUser);
        }
        let mut users = self.users.write();
        let removed =
            names.iter().filter(|n| std::str::from_utf8(n).ok().and_then(|n| users.remove(n)).is_some()).count();
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(removed)
    }

    /// Every user name, sorted.
    pub fn usernames(&self) -> Vec<String> {
        self.users.read().keys().cloned().collect()
    }

    /// Every user, sorted by name.
    pub fn users(&self) -> Vec<Arc<User>> {
        self.users.read().values().cloned().collect()
    }

    /// `ACL LOAD`: replaces every user with the file's, or changes nothing on any error.
    pub fn load(&self) -> Result<(), AclError> {
        let path = self.options.file.as_ref().ok_or(AclError::NoFile)?;
        let users = self.parse_file(path)?;
        *self.users.write() = users;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// `ACL SAVE`: writes every user to the file (a new file renamed over the old one, so a
    /// crash leaves one or the other; mode 0600: it holds password hashes).
    pub fn save(&self) -> Result<(), AclError> {
        let path = self.options.file.as_ref().ok_or(AclError::NoFile)?;
        let mut text = String::new();
        for user in self.users() {
            text.push_str(&user.describe());
            text.push('\n');
        }
        write_private(path, text.as_bytes()).map_err(|e| AclError::File(format!("writing {}: {e}", path.display())))
    }

    fn with_default(&self, mut users: BTreeMap<String, Arc<User>>) -> BTreeMap<String, Arc<User>> {
        users.entry(DEFAULT_USER.into()).or_insert_with(|| Arc::new(User::default_user(&self.catalog)));
        users
    }

    /// The users of an ACL file (one `user <name> <rules...>` per line; blank lines and
    /// `#` comments skipped), with `default` added if the file has none.
    fn parse_file(&self, path: &Path) -> Result<BTreeMap<String, Arc<User>>, AclError> {
        let text = read_bounded(path).map_err(|e| AclError::File(format!("reading {}: {e}", path.display())))?;
        let text = String::from_utf8(text)
            .map_err(|_| AclError::File(format!("{}: the ACL file is not UTF-8", path.display())))?;
        let mut users = BTreeMap::new();
        let mut errors = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("{}:{}", path.display(), number + 1);
            let mut words = line.split_ascii_whitespace();
            let (Some("user"), Some(name)) = (words.next(), words.next()) else {
                errors.push(format!("{at}: should start with user keyword"));
                continue;
            };
            if !user::valid_username(name.as_bytes()) {
                errors.push(format!("{at}: {}", AclError::BadUsername));
                continue;
            }
            if users.contains_key(name) {
                errors.push(format!("{at}: Duplicate user '{name}' found"));
                continue;
            }
            if users.len() >= MAX_USERS {
                errors.push(format!("{at}: {}", AclError::TooManyUsers));
                break;
            }
            let mut new = User::new(name);
            let rules: Vec<&[u8]> = words.map(str::as_bytes).collect();
            match apply_rules(&mut new, &rules, &self.catalog) {
                Ok(()) => {
                    users.insert(name.to_string(), Arc::new(new));
                }
                Err(e) => errors.push(format!("{at}: {e}")),
            }
        }
        if !errors.is_empty() {
            return Err(AclError::File(errors.join(" ")));
        }
        Ok(self.with_default(users))
    }
}

fn apply_rules(user: &mut User, rules: &[&[u8]], catalog: &Catalog) -> Result<(), AclError> {
    for rule in rules {
        user.apply(rule, catalog).map_err(|reason| AclError::Rule { rule: printable(rule), reason })?;
    }
    Ok(())
}

/// A rule for an error message: passwords (`>...`, `<...`) are not echoed.
fn printable(rule: &[u8]) -> String {
    match rule.first() {
        Some(b'>') | Some(b'<') => format!("{}***", rule[0] as char),
        _ => String::from_utf8_lossy(rule).into_owned(),
    }
}

fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let mut text = Vec::new();
    file.take(MAX_ACL_FILE_BYTES + 1).read_to_end(&mut text)?;
    if text.len() as u64 > MAX_ACL_FILE_BYTES {
        return Err(std::io::Error::other(format!("larger than {MAX_ACL_FILE_BYTES} bytes")));
    }
    Ok(text)
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Arc<Catalog> {
        let mut c = Catalog::new();
        c.add("get", Categories::READ, None);
        c.add("set", Categories::WRITE, None);
        Arc::new(c)
    }

    #[test]
    fn requirepass_closes_the_default_user() {
        let acl = Acl::new(catalog(), AclOptions { requirepass: Some("s3cret".into()), file: None }).unwrap();
        assert!(!acl.is_open() && acl.initial_user().is_none());
        assert!(acl.authenticate(None, b"s3cret").is_ok());
        assert_eq!(acl.authenticate(None, b"wrong").unwrap_err(), AuthFailure::WrongPass);
        assert!(acl.authenticate(Some(b"default"), b"s3cret").is_ok());
        let open = Acl::open(catalog());
        assert!(open.is_open());
        assert_eq!(open.authenticate(None, b"x").unwrap_err(), AuthFailure::NoDefaultPassword);
    }

    #[test]
    fn check_maps_denials_to_redis_texts() {
        let acl = Acl::open(catalog());
        acl.set_user(b"ro", &[b"on", b"nopass", b"+get", b"%R~k*"]).unwrap();
        assert_eq!(acl.check("ro", "get", [(&b"k1"[..], KeyAccess::Read)]), Ok(()));
        assert_eq!(
            acl.check("ro", "set", [(&b"k1"[..], KeyAccess::Write)]),
            Err("NOPERM User ro has no permissions to run the 'set' command".into())
        );
        assert_eq!(
            acl.check("ro", "get", [(&b"x"[..], KeyAccess::Read)]),
            Err("NOPERM No permissions to access a key".into())
        );
        assert!(acl.check("gone", "get", []).is_err());
        assert!(acl.check("default", "get", [(&b"x"[..], KeyAccess::ReadWrite)]).is_ok());
    }

    #[test]
    fn set_user_is_all_or_nothing_and_bumps_the_generation() {
        let acl = Acl::open(catalog());
        let g = acl.generation();
        acl.set_user(b"alice", &[b"on", b">pw", b"+get"]).unwrap();
        assert!(acl.generation() > g);
        let err = acl.set_user(b"alice", &[b"+set", b">other", b"+nosuch"]).unwrap_err();
        assert_eq!(err.to_string(), "Error in ACL SETUSER modifier '+nosuch': Unknown command or category name in ACL");
        let alice = acl.user("alice").unwrap();
        assert!(!alice.accepts(b"other"), "a failed SETUSER changes nothing");
        assert_eq!(alice.describe_commands(), "-@all +get");
        let err = acl.set_user(b"alice", &[b"<missing"]).unwrap_err();
        assert!(err.to_string().starts_with("Error in ACL SETUSER modifier '<***'"), "{err}");
        assert_eq!(acl.set_user(b"a b", &[]), Err(AclError::BadUsername));
        assert_eq!(acl.delete_users(&[b"default"]), Err(AclError::DefaultUser));
        assert_eq!(acl.delete_users(&[b"alice", b"nobody"]), Ok(1));
        assert_eq!(acl.usernames(), ["default"]);
    }

    #[test]
    fn file_round_trip_and_errors_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("users.acl");
        let acl = Acl::new(catalog(), AclOptions { requirepass: None, file: Some(path.clone()) }).unwrap();
        acl.set_user(b"alice", &[b"on", b">pw", b"+get", b"%R~k:*"]).unwrap();
        acl.save().unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("pw ") && text.contains("user alice on #"), "{text}");

        let reloaded = Acl::new(catalog(), AclOptions { requirepass: None, file: Some(path.clone()) }).unwrap();
        assert_eq!(reloaded.user("alice").unwrap().describe(), acl.user("alice").unwrap().describe());
        assert!(reloaded.authenticate(Some(b"alice"), b"pw").is_ok());

        std::fs::write(&path, "# users\n\nuser bob on +get\nuser bob off\nuser carol +bogus\nnonsense\n").unwrap();
        let err = reloaded.load().unwrap_err().to_string();
        assert!(err.contains(":4: Duplicate user 'bob' found"), "{err}");
        assert!(err.contains(":5: Error in ACL SETUSER modifier '+bogus'"), "{err}");
        assert!(err.contains(":6: should start with user keyword"), "{err}");
        assert!(reloaded.user("alice").is_some() && reloaded.user("bob").is_none(), "a bad file changes nothing");

        std::fs::write(&path, "user bob on nopass +get ~*\n").unwrap();
        reloaded.load().unwrap();
        assert_eq!(reloaded.usernames(), ["bob", "default"], "LOAD replaces the users and keeps a default");
        assert_eq!(Acl::open(catalog()).load(), Err(AclError::NoFile));
    }
}
