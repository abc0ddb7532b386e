//! AUTH and ACL: authenticating a connection and managing users, with Redis 7's syntax,
//! replies and error texts. The rules themselves live in [`crate::acl`].

use rand::RngCore;

use super::{acl_id, arity_error, fail, lookup, unsupported_subcommand, Client, CmdResult};
use crate::acl::{AclError, Categories, Denial};
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};

/// `AUTH password` (the default user) or `AUTH username password`.
pub(super) fn auth(c: &mut Client, cmd: &Command) -> CmdResult {
    match cmd.len() {
        2 => c.authenticate(None, cmd.arg(1))?,
        3 => c.authenticate(Some(cmd.arg(1)), cmd.arg(2))?,
        _ => return Err(fail("ERR syntax error")),
    }
    Ok(Reply::ok())
}

fn acl_failure(e: AclError) -> super::Failure {
    fail(format!("ERR {e}"))
}

/// `ACL CAT|DELUSER|DRYRUN|GENPASS|GETUSER|LIST|LOAD|SAVE|SETUSER|USERS|WHOAMI`.
pub(super) fn acl(c: &mut Client, cmd: &Command) -> CmdResult {
    let sub = cmd.arg(1);
    let upper = sub.to_ascii_uppercase();
    let argc = cmd.len();
    match upper.as_slice() {
        b"CAT" if argc <= 3 => cat(c, cmd.get(2)),
        b"DELUSER" if argc >= 3 => {
            let names: Vec<&[u8]> = cmd.args().skip(2).collect();
            Ok(Reply::Integer(c.acl.delete_users(&names).map_err(acl_failure)? as i64))
        }
        b"DRYRUN" if argc >= 4 => dry_run(c, cmd),
        b"GENPASS" if argc <= 3 => genpass(cmd.get(2)),
        b"GETUSER" if argc == 3 => Ok(getuser(c, cmd.arg(2))),
        b"LIST" if argc == 2 => {
            Ok(Reply::Array(c.acl.users().iter().map(|u| Reply::Bulk(u.describe().into_bytes())).collect()))
        }
        b"USERS" if argc == 2 => Ok(Reply::Array(c.acl.usernames().iter().map(|n| Reply::bulk_str(n)).collect())),
        b"LOAD" if argc == 2 => {
            c.acl.load().map_err(acl_failure)?;
            Ok(Reply::ok())
        }
        b"SAVE" if argc == 2 => {
            c.acl.save().map_err(acl_failure)?;
            Ok(Reply::ok())
        }
        b"SETUSER" if argc >= 3 => {
            let rules: Vec<&[u8]> = cmd.args().skip(3).collect();
            c.acl.set_user(cmd.arg(2), &rules).map_err(acl_failure)?;
            Ok(Reply::ok())
        }
        b"WHOAMI" if argc == 2 => Ok(c.user().map_or(Reply::Nil, Reply::bulk_str)),
        b"CAT" | b"DELUSER" | b"DRYRUN" | b"GENPASS" | b"GETUSER" | b"LIST" | b"USERS" | b"LOAD" | b"SAVE"
        | b"SETUSER" | b"WHOAMI" => {
            Ok(arity_error(&format!("acl|{}", String::from_utf8_lossy(&upper).to_ascii_lowercase())))
        }
        _ => Err(unsupported_subcommand("ACL", sub)),
    }
}

/// `ACL CAT`: the categories; `ACL CAT category`: the commands and subcommands in it.
fn cat(c: &Client, category: Option<&[u8]>) -> CmdResult {
    let Some(name) = category else {
        return Ok(Reply::Array(crate::acl::category::NAMES.iter().map(|n| Reply::bulk_str(n)).collect()));
    };
    let Some(category) = Categories::by_name(name) else {
        return Err(fail(format!("ERR Unknown category '{}'", String::from_utf8_lossy(name))));
    };
    let catalog = c.acl.catalog();
    Ok(Reply::Array(catalog.in_category(category).map(|id| Reply::bulk_str(&catalog.entry(id).name)).collect()))
}

/// `ACL GETUSER name`: flags, password hashes, commands, keys, channels, selectors (none).
fn getuser(c: &Client, name: &[u8]) -> Reply {
    let Some(user) = std::str::from_utf8(name).ok().and_then(|n| c.acl.user(n)) else {
        return Reply::Nil;
    };
    Reply::map([
        ("flags", Reply::Array(user.flags().into_iter().map(Reply::bulk_str).collect())),
        ("passwords", Reply::Array(user.password_hashes().iter().map(|h| Reply::bulk_str(h)).collect())),
        ("commands", Reply::bulk_str(&user.describe_commands())),
        ("keys", Reply::bulk_str(&user.describe_keys())),
        ("channels", Reply::bulk_str(&user.describe_channels())),
        ("selectors", Reply::Array(vec![])),
    ])
}

/// `ACL DRYRUN user command [arg ...]`: whether `user` could run the command (OK, or the
/// reason as a bulk string), without running it.
fn dry_run(c: &Client, cmd: &Command) -> CmdResult {
    let name = cmd.arg(2);
    let Some(user) = std::str::from_utf8(name).ok().and_then(|n| c.acl.user(n)) else {
        return Err(fail(format!("ERR User '{}' not found", String::from_utf8_lossy(name))));
    };
    let tried = Command::from_args(cmd.args().skip(3));
    let Some((index, spec)) = lookup(tried.arg(0)) else {
        return Err(fail(format!("ERR Command '{}' not found", String::from_utf8_lossy(tried.arg(0)))));
    };
    if !spec.arity_ok(tried.len()) {
        return Ok(arity_error(spec.name));
    }
    let (id, _) = acl_id(index, spec, &tried);
    Ok(match user.check(id, spec.keys_of(&tried)) {
        Ok(()) => Reply::ok(),
        Err(Denial::Command) => Reply::Bulk(
            format!("User {} has no permissions to run the '{}' command", user.name(), c.acl.catalog().entry(id).name)
                .into_bytes(),
        ),
        Err(Denial::Key(position)) => Reply::Bulk(
            format!(
                "User {} has no permissions to access the '{}' key",
                user.name(),
                String::from_utf8_lossy(tried.arg(position))
            )
            .into_bytes(),
        ),
    })
}

/// Most bits `ACL GENPASS` makes (Redis' limit).
const MAX_GENPASS_BITS: i64 = 4096;

/// `ACL GENPASS [bits]`: a random password, hex, 256 bits unless asked otherwise.
fn genpass(bits: Option<&[u8]>) -> CmdResult {
    let bits = match bits {
        None => 256,
        Some(arg) => match parse_i64(arg) {
            Some(b) if (1..=MAX_GENPASS_BITS).contains(&b) => b,
            _ => {
                return Err(fail(
                    "ERR ACL GENPASS argument must be the number of bits for the output password, a positive number up to 4096",
                ))
            }
        },
    };
    let chars = (bits as usize).div_ceil(4);
    let mut bytes = vec![0u8; chars.div_ceil(2)];
    rand::rng().fill_bytes(&mut bytes);
    let mut text = crate::acl::user::to_hex(&bytes);
    text.truncate(chars);
    Ok(Reply::Bulk(text.into_bytes()))
}
