//! Connection and server commands: PING, ECHO, COMMAND (COUNT, INFO, LIST), CLIENT (ID,
//! GETNAME, SETNAME, SETINFO), HELLO, SELECT, QUIT. The introspection the tools read (INFO,
//! CONFIG, the rest of CLIENT and COMMAND, ...) is `introspection`'s.

use super::{arity_error, fail, lookup, unsupported_subcommand, Client, CmdResult, CommandSpec, COMMANDS};
use crate::info::REDIS_COMPAT_VERSION;
use crate::reply::{Protocol, Reply};
use crate::resp::{parse_i64, Command};

pub(super) fn ping(_c: &mut Client, cmd: &Command) -> CmdResult {
    match cmd.len() {
        1 => Ok(Reply::Status("PONG".into())),
        2 => Ok(Reply::Bulk(cmd.arg(1).to_vec())),
        _ => Ok(arity_error("ping")),
    }
}

pub(super) fn echo(_c: &mut Client, cmd: &Command) -> CmdResult {
    Ok(Reply::Bulk(cmd.arg(1).to_vec()))
}

pub(super) fn quit(c: &mut Client, _cmd: &Command) -> CmdResult {
    c.closing = true;
    Ok(Reply::ok())
}

/// racekv has one keyspace: `SELECT 0` is accepted (clients send it by habit), others refused.
pub(super) fn select(_c: &mut Client, cmd: &Command) -> CmdResult {
    match parse_i64(cmd.arg(1)) {
        Some(0) => Ok(Reply::ok()),
        Some(_) => Err(fail("ERR DB index is out of range")),
        None => Err(fail("ERR value is not an integer or out of range")),
    }
}

/// The Redis 7 `COMMAND INFO` entry of `spec`: name, arity, flags, key positions, ACL
/// categories, then empty tips, key specs and subcommands.
fn command_info(spec: &CommandSpec) -> Reply {
    Reply::Array(vec![
        Reply::bulk_str(spec.name),
        Reply::Integer(i64::from(spec.arity)),
        Reply::Array(spec.flags.iter().map(|f| Reply::Status((*f).into())).collect()),
        Reply::Integer(i64::from(spec.keys.first)),
        Reply::Integer(i64::from(spec.keys.last)),
        Reply::Integer(i64::from(spec.keys.step)),
        Reply::Array(spec.categories.names().map(|n| Reply::Status(format!("@{n}").into())).collect()),
        Reply::Array(vec![]),
        Reply::Array(vec![]),
        Reply::Array(vec![]),
    ])
}

/// `COMMAND`, `COMMAND COUNT|INFO|LIST` (`introspection::command` has the others).
pub(super) fn command(_c: &mut Client, cmd: &Command) -> CmdResult {
    let Some(sub) = cmd.get(1) else {
        return Ok(Reply::Array(COMMANDS.iter().map(command_info).collect()));
    };
    let upper = sub.to_ascii_uppercase();
    match upper.as_slice() {
        b"COUNT" if cmd.len() == 2 => Ok(Reply::Integer(COMMANDS.len() as i64)),
        b"COUNT" => Ok(arity_error("command|count")),
        b"LIST" if cmd.len() == 2 => Ok(Reply::Array(COMMANDS.iter().map(|c| Reply::bulk_str(c.name)).collect())),
        b"INFO" if cmd.len() == 2 => Ok(Reply::Array(COMMANDS.iter().map(command_info).collect())),
        b"INFO" => Ok(Reply::Array(
            cmd.args().skip(2).map(|name| lookup(name).map_or(Reply::Nil, |(_, spec)| command_info(spec))).collect(),
        )),
        _ => Err(unsupported_subcommand("COMMAND", sub)),
    }
}

/// Redis' rule for client names: printable ASCII without spaces.
fn valid_client_name(name: &[u8]) -> bool {
    name.iter().all(|&b| (b'!'..=b'~').contains(&b))
}

fn set_name(c: &mut Client, name: &[u8]) -> Result<(), super::Failure> {
    if !valid_client_name(name) {
        return Err(fail("ERR Client names cannot contain spaces, newlines or special characters."));
    }
    c.name = if name.is_empty() { None } else { Some(name.to_vec()) };
    Ok(())
}

/// `CLIENT SETNAME|GETNAME|ID|SETINFO`; other subcommands are refused by name.
pub(super) fn client(c: &mut Client, cmd: &Command) -> CmdResult {
    let sub = cmd.arg(1);
    let upper = sub.to_ascii_uppercase();
    match (upper.as_slice(), cmd.len()) {
        (b"SETNAME", 3) => {
            set_name(c, cmd.arg(2))?;
            Ok(Reply::ok())
        }
        (b"SETNAME", _) => Ok(arity_error("client|setname")),
        (b"GETNAME", 2) => Ok(c.name.clone().map_or(Reply::Nil, Reply::Bulk)),
        (b"GETNAME", _) => Ok(arity_error("client|getname")),
        (b"ID", 2) => Ok(Reply::Integer(c.id as i64)),
        // Client libraries (redis-rs, redis-py, ...) announce themselves on connect.
        (b"SETINFO", 4) => {
            let value = cmd.arg(3);
            if !valid_client_name(value) {
                return Err(fail("ERR lib-name and lib-ver cannot contain spaces, newlines or special characters."));
            }
            let attribute = cmd.arg(2).to_ascii_uppercase();
            match attribute.as_slice() {
                b"LIB-NAME" => c.lib_name = Some(value.to_vec()),
                b"LIB-VER" => c.lib_ver = Some(value.to_vec()),
                _ => return Err(fail(format!("ERR Unrecognized option '{}'", String::from_utf8_lossy(cmd.arg(2))))),
            }
            Ok(Reply::ok())
        }
        (b"SETINFO", _) => Ok(arity_error("client|setinfo")),
        (b"ID", _) => Ok(arity_error("client|id")),
        _ => Err(unsupported_subcommand("CLIENT", sub)),
    }
}

/// `HELLO [2|3 [AUTH user pass] [SETNAME name]]`: switches the connection to RESP2 or RESP3
/// and describes the server. AUTH authenticates first; an unauthenticated connection gets
/// `NOAUTH` unless it authenticates here.
pub(super) fn hello(c: &mut Client, cmd: &Command) -> CmdResult {
    let mut protocol = c.protocol;
    if let Some(version) = cmd.get(1) {
        protocol = match parse_i64(version) {
            Some(2) => Protocol::Resp2,
            Some(3) => Protocol::Resp3,
            Some(_) => return Err(fail("NOPROTO unsupported protocol version")),
            None => return Err(fail("ERR Protocol version is not an integer or out of range")),
        };
    }
    let mut new_name = None;
    let mut credentials = None;
    let mut i = 2;
    while i < cmd.len() {
        let option = cmd.arg(i).to_ascii_uppercase();
        match option.as_slice() {
            b"AUTH" if i + 2 < cmd.len() => {
                credentials = Some((cmd.arg(i + 1), cmd.arg(i + 2)));
                i += 3;
            }
            b"SETNAME" if i + 1 < cmd.len() => {
                new_name = Some(cmd.arg(i + 1));
                i += 2;
            }
            _ => {
                return Err(fail(format!("ERR Syntax error in HELLO option '{}'", String::from_utf8_lossy(cmd.arg(i)))))
            }
        }
    }
    if let Some((username, password)) = credentials {
        c.authenticate(Some(username), password)?;
    }
    if c.user.is_none() {
        return Err(fail("NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time"));
    }
    if let Some(name) = new_name {
        set_name(c, name)?;
    }
    c.protocol = protocol;
    Ok(Reply::map([
        ("server", Reply::bulk_str("redis")),
        ("version", Reply::bulk_str(REDIS_COMPAT_VERSION)),
        ("proto", Reply::Integer(protocol.version())),
        ("id", Reply::Integer(c.id as i64)),
        ("mode", Reply::bulk_str("standalone")),
        ("role", Reply::bulk_str("master")),
        ("modules", Reply::Array(vec![])),
    ]))
}
