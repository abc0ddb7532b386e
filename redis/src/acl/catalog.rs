//! What ACL rules name: every command and subcommand (`get`, `config|get`) with its
//! categories, numbered densely so a user's permissions are a fixed bit set.
//!
//! The command layer builds the catalog from its command table; this module knows nothing
//! else about commands.

use super::category::Categories;

/// Most commands and subcommands a catalog may hold (the width of [`CommandSet`]).
pub const MAX_COMMAND_IDS: usize = 512;

/// A command's (or subcommand's) number in its [`Catalog`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommandId(pub u16);

/// One command or subcommand.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Lower case; `container|sub` for a subcommand.
    pub name: String,
    /// The ACL categories it belongs to.
    pub categories: Categories,
    /// For a subcommand, its container.
    pub container: Option<CommandId>,
}

/// Every command and subcommand ACL rules can name.
#[derive(Debug, Default)]
pub struct Catalog {
    entries: Vec<Entry>,
}

impl Catalog {
    /// An empty catalog.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a command (`container` None) or a subcommand; returns its id.
    ///
    /// # Panics
    /// Past [`MAX_COMMAND_IDS`] entries, or a duplicate name: the table is static, so either
    /// is a programming error.
    pub fn add(&mut self, name: &str, categories: Categories, container: Option<CommandId>) -> CommandId {
        assert!(self.entries.len() < MAX_COMMAND_IDS, "more commands than a CommandSet holds");
        let full = match container {
            Some(parent) => format!("{}|{name}", self.entries[usize::from(parent.0)].name),
            None => name.to_string(),
        };
        assert!(self.lookup(full.as_bytes()).is_none(), "duplicate command {full}");
        assert_eq!(full, full.to_ascii_lowercase(), "command names are lower case");
        self.entries.push(Entry { name: full, categories, container });
        CommandId(self.entries.len() as u16 - 1)
    }

    /// The entry of `id`.
    pub fn entry(&self, id: CommandId) -> &Entry {
        &self.entries[usize::from(id.0)]
    }

    /// The id named `name` (`get`, `config|get`; case-insensitive).
    pub fn lookup(&self, name: &[u8]) -> Option<CommandId> {
        self.entries.iter().position(|e| e.name.as_bytes().eq_ignore_ascii_case(name)).map(|i| CommandId(i as u16))
    }

    /// Every id, in table order.
    pub fn ids(&self) -> impl Iterator<Item = CommandId> + '_ {
        (0..self.entries.len()).map(|i| CommandId(i as u16))
    }

    /// `id` and, for a container, its subcommands.
    pub fn family(&self, id: CommandId) -> impl Iterator<Item = CommandId> + '_ {
        self.ids().filter(move |&other| other == id || self.entry(other).container == Some(id))
    }

    /// The ids in `category`.
    pub fn in_category(&self, category: Categories) -> impl Iterator<Item = CommandId> + '_ {
        self.ids().filter(move |&id| self.entry(id).categories.contains(category))
    }
}

/// A set of command ids (what a user may run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandSet([u64; MAX_COMMAND_IDS / 64]);

impl CommandSet {
    /// No command.
    pub const fn empty() -> Self {
        Self([0; MAX_COMMAND_IDS / 64])
    }

    /// Every id (of any catalog).
    pub const fn all() -> Self {
        Self([u64::MAX; MAX_COMMAND_IDS / 64])
    }

    /// Whether `id` is in the set.
    pub fn contains(&self, id: CommandId) -> bool {
        let i = usize::from(id.0);
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    /// Adds or removes `id`.
    pub fn set(&mut self, id: CommandId, allowed: bool) {
        let i = usize::from(id.0);
        if allowed {
            self.0[i / 64] |= 1 << (i % 64);
        } else {
            self.0[i / 64] &= !(1 << (i % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subcommands_are_named_under_their_container_and_sets_hold_ids() {
        let mut catalog = Catalog::new();
        let get = catalog.add("get", Categories::READ, None);
        let config = catalog.add("config", Categories::ADMIN, None);
        let config_get = catalog.add("get", Categories::ADMIN.and(Categories::SLOW), Some(config));
        assert_eq!(catalog.entry(config_get).name, "config|get");
        assert_eq!(catalog.lookup(b"CONFIG|GET"), Some(config_get));
        assert_eq!(catalog.lookup(b"get"), Some(get));
        assert_eq!(catalog.family(config).collect::<Vec<_>>(), [config, config_get]);
        assert_eq!(catalog.in_category(Categories::SLOW).collect::<Vec<_>>(), [config_get]);
        let mut set = CommandSet::empty();
        set.set(config_get, true);
        assert!(set.contains(config_get) && !set.contains(get));
        set.set(config_get, false);
        assert_eq!(set, CommandSet::empty());
        assert!(CommandSet::all().contains(CommandId(MAX_COMMAND_IDS as u16 - 1)));
    }
}
