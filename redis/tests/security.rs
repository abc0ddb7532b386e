//! Access control and the cross-protocol guard, through real clients: redis-cli and the
//! `redis` crate authenticate with `requirepass` and with ACL users; a browser-style HTTP
//! POST to the Redis port executes nothing.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{cli, cli_output};
use racekv_redis::acl::{Acl, AclOptions};
use racekv_redis::{RedisServer, ServerOptions};

fn with_acl(requirepass: Option<&str>, file: Option<std::path::PathBuf>) -> ServerOptions {
    let options = AclOptions { requirepass: requirepass.map(String::from), file };
    ServerOptions { acl: Arc::new(Acl::new(racekv_redis::commands::catalog(), options).unwrap()), ..Default::default() }
}

fn connect(server: &RedisServer, userinfo: &str) -> redis::RedisResult<redis::Connection> {
    let url = format!("redis://{userinfo}{}/?protocol=resp2", server.local_addr());
    redis::Client::open(url)?.get_connection()
}

fn error_code(e: &redis::RedisError) -> String {
    format!("{} {}", e.code().unwrap_or("?"), e.detail().unwrap_or(""))
}

#[test]
fn requirepass_with_redis_cli_and_the_redis_crate() {
    let Some(bin) = common::redis_tool("redis-cli") else { return };
    let (server, store) = common::start(with_acl(Some("s3cret pass"), None));
    let port = server.local_addr().port();
    let out = cli(&bin, port, &["SET", "k", "v"], b"");
    assert!(out.starts_with("NOAUTH Authentication required."), "{out}");
    assert_eq!(store.peek(b"k"), None);
    assert_eq!(cli(&bin, port, &["-a", "s3cret pass", "--no-auth-warning", "SET", "k", "v"], b""), "OK\n");
    assert_eq!(store.peek(b"k"), Some(b"v".to_vec()));
    let out = cli(&bin, port, &["-a", "wrong", "--no-auth-warning", "GET", "k"], b"");
    assert!(out.contains("WRONGPASS") || out.contains("NOAUTH"), "{out}");

    let mut con = connect(&server, ":s3cret%20pass@").unwrap();
    let value: String = redis::cmd("GET").arg("k").query(&mut con).unwrap();
    assert_eq!(value, "v");
    let e = connect(&server, ":nope@").err().expect("a wrong password is refused");
    assert_eq!(e.kind(), redis::ErrorKind::AuthenticationFailed, "{e}");

    // AUTH and HELLO AUTH on a raw connection, in Redis' words.
    let mut raw = common::raw(&server);
    let (reply, _) = common::exchange(
        &mut raw,
        b"GET k\r\nHELLO 2\r\nAUTH nope\r\nAUTH default s3cret\r\nHELLO 2 AUTH default nope\r\nHELLO 2 AUTH default \"s3cret pass\"\r\nGET k\r\nACL WHOAMI\r\n",
        false,
        Duration::from_secs(5),
    );
    let reply = String::from_utf8_lossy(&reply);
    let lines: Vec<&str> = reply.split("\r\n").collect();
    assert_eq!(lines[0], "-NOAUTH Authentication required.");
    assert!(lines[1].starts_with("-NOAUTH HELLO must be called with the client already authenticated"), "{reply}");
    assert_eq!(lines[2], "-WRONGPASS invalid username-password pair or user is disabled.");
    assert_eq!(lines[3], "-WRONGPASS invalid username-password pair or user is disabled.");
    assert_eq!(lines[4], "-WRONGPASS invalid username-password pair or user is disabled.");
    assert!(reply.contains("$5\r\nredis\r\n") && reply.ends_with("$1\r\nv\r\n$7\r\ndefault\r\n"), "{reply}");
}

#[test]
fn acl_users_with_command_and_key_permissions() {
    let Some(bin) = common::redis_tool("redis-cli") else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("users.acl");
    let (server, store) = common::start(with_acl(Some("admin-pw"), Some(file.clone())));
    let port = server.local_addr().port();
    let admin = |args: &[&str]| {
        let mut all = vec!["--user", "default", "--pass", "admin-pw", "--no-auth-warning"];
        all.extend_from_slice(args);
        cli(&bin, port, &all, b"").trim_end().to_string() + "\n"
    };
    let alice = |args: &[&str]| {
        let mut all = vec!["--user", "alice", "--pass", "alice-pw", "--no-auth-warning"];
        all.extend_from_slice(args);
        // redis-cli follows an error reply with an empty line when not on a terminal.
        cli(&bin, port, &all, b"").trim_end().to_string() + "\n"
    };
    assert_eq!(
        admin(&["ACL", "SETUSER", "alice", "on", ">alice-pw", "~cache:*", "%R~shared:*", "+@read", "+@write", "-del"]),
        "OK\n"
    );
    assert_eq!(alice(&["SET", "cache:1", "one"]), "OK\n");
    assert_eq!(alice(&["GET", "cache:1"]), "one\n");
    assert_eq!(alice(&["ACL", "WHOAMI"]), "NOPERM User alice has no permissions to run the 'acl|whoami' command\n");
    assert_eq!(alice(&["SET", "other", "x"]), "NOPERM No permissions to access a key\n");
    assert_eq!(alice(&["SET", "shared:1", "x"]), "NOPERM No permissions to access a key\n");
    assert_eq!(alice(&["GET", "shared:1"]), "\n");
    assert_eq!(alice(&["MGET", "cache:1", "other"]), "NOPERM No permissions to access a key\n");
    assert_eq!(alice(&["DEL", "cache:1"]), "NOPERM User alice has no permissions to run the 'del' command\n");
    assert_eq!(store.peek(b"other"), None);
    assert_eq!(store.peek(b"cache:1"), Some(b"one".to_vec()));

    let list = admin(&["ACL", "LIST"]);
    assert!(
        list.contains("user alice on #")
            && list.contains(" ~cache:* %R~shared:* resetchannels -@all +@read +@write -del"),
        "{list}"
    );
    assert!(!list.contains("alice-pw"), "passwords are listed only as hashes");
    assert_eq!(admin(&["ACL", "USERS"]), "alice\ndefault\n");
    assert_eq!(
        admin(&["ACL", "DRYRUN", "alice", "del", "cache:1"]),
        "User alice has no permissions to run the 'del' command\n"
    );
    assert_eq!(admin(&["ACL", "DRYRUN", "alice", "get", "cache:1"]), "OK\n");
    assert!(admin(&["ACL", "CAT"]).contains("dangerous\n"));
    assert!(admin(&["ACL", "CAT", "dangerous"]).contains("config|get\n"));
    assert_eq!(admin(&["ACL", "GENPASS", "32"]).trim().len(), 8);
    let getuser = admin(&["ACL", "GETUSER", "alice"]);
    assert!(getuser.starts_with("flags\non\npasswords\n"), "{getuser}");
    assert_eq!(
        admin(&["ACL", "SETUSER", "alice", "+bogus"]),
        "ERR Error in ACL SETUSER modifier '+bogus': Unknown command or category name in ACL\n"
    );

    // The redis crate as alice.
    let mut con = connect(&server, "alice:alice-pw@").unwrap();
    let value: String = redis::cmd("GET").arg("cache:1").query(&mut con).unwrap();
    assert_eq!(value, "one");
    let e = redis::cmd("GET").arg("secret").query::<Option<String>>(&mut con).unwrap_err();
    assert!(error_code(&e).starts_with("NOPERM"), "{e}");

    // SAVE, change, LOAD: back to what was saved.
    assert_eq!(admin(&["ACL", "SAVE"]), "OK\n");
    assert_eq!(admin(&["ACL", "SETUSER", "bob", "on", "nopass", "+@all", "~*"]), "OK\n");
    assert_eq!(admin(&["ACL", "LOAD"]), "OK\n");
    assert_eq!(admin(&["ACL", "USERS"]), "alice\ndefault\n");
    assert_eq!(alice(&["GET", "cache:1"]), "one\n");

    // A deleted user's connections are closed at their next command.
    assert_eq!(admin(&["ACL", "DELUSER", "alice"]), "1\n");
    let e = redis::cmd("GET").arg("cache:1").query::<Option<String>>(&mut con).unwrap_err();
    assert!(e.to_string().contains("deleted") || e.is_connection_dropped() || e.is_io_error(), "{e}");
    let out = cli_output(&bin, port, &["--user", "alice", "--pass", "alice-pw", "--no-auth-warning", "GET", "x"], b"");
    assert!(String::from_utf8_lossy(&out.stderr).contains("WRONGPASS"), "{out:?}");
}

#[test]
fn an_http_post_to_the_redis_port_executes_nothing() {
    let (server, store) = common::start(ServerOptions::default());
    let before = metric("racekv_redis_cross_protocol_total");
    let mut stream = common::raw(&server);
    let post = b"POST / HTTP/1.1\r\nHost: 127.0.0.1:6380\r\nContent-Type: text/plain\r\nContent-Length: 22\r\n\r\nSET pwned 1\r\nDEL safe\r\n";
    let (reply, closed) = common::exchange(&mut stream, post, true, Duration::from_secs(5));
    assert!(closed, "the connection is closed at once");
    assert!(reply.is_empty(), "nothing is answered: {:?}", String::from_utf8_lossy(&reply));
    assert_eq!(store.peek(b"pwned"), None);

    // A GET request is not a Redis command either; its Host: line ends it.
    let mut stream = common::raw(&server);
    let get = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\nSET pwned 1\r\n";
    let (reply, closed) = common::exchange(&mut stream, get, true, Duration::from_secs(5));
    assert!(closed);
    assert!(String::from_utf8_lossy(&reply).starts_with("-ERR wrong number of arguments for 'get' command"));
    assert_eq!(store.peek(b"pwned"), None);
    assert!(metric("racekv_redis_cross_protocol_total") >= before + 2.0);

    // The server keeps serving.
    let mut con = connect(&server, "").unwrap();
    let _: () = redis::cmd("SET").arg("after").arg("1").query(&mut con).unwrap();
}

fn metric(name: &str) -> f64 {
    racekv_telemetry::render()
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or(0.0)
}
