//! The Redis front end (over the MemStore test double) through the `redis` client crate,
//! plus connection management: max clients, idle timeout, shutdown.

mod common;

use std::time::Duration;

use racekv_redis::ServerOptions;
use redis::{cmd, Connection};

fn connect(server: &racekv_redis::RedisServer) -> Connection {
    let client = redis::Client::open(format!("redis://{}/", server.local_addr())).unwrap();
    client.get_connection().expect("connect with redis-rs")
}

#[test]
fn string_commands_through_redis_rs() {
    let (server, store) = common::start(ServerOptions::default());
    let mut con = connect(&server);
    assert_eq!(cmd("PING").query::<String>(&mut con).unwrap(), "PONG");
    cmd("SET").arg("k").arg(b"v\r\n\0").query::<()>(&mut con).unwrap();
    assert_eq!(cmd("GET").arg("k").query::<Vec<u8>>(&mut con).unwrap(), b"v\r\n\0");
    assert_eq!(cmd("GET").arg("missing").query::<Option<String>>(&mut con).unwrap(), None);
    assert_eq!(cmd("SET").arg("k").arg("w").arg("NX").query::<Option<String>>(&mut con).unwrap(), None);
    assert_eq!(cmd("SETNX").arg("j").arg("1").query::<i64>(&mut con).unwrap(), 1);
    assert_eq!(cmd("EXISTS").arg("k").arg("j").arg("nope").query::<i64>(&mut con).unwrap(), 2);
    assert_eq!(cmd("DEL").arg("k").arg("j").arg("nope").query::<i64>(&mut con).unwrap(), 2);
    assert_eq!(store.peek(b"k"), None);

    assert_eq!(cmd("INCR").arg("n").query::<i64>(&mut con).unwrap(), 1);
    assert_eq!(cmd("INCRBY").arg("n").arg(41).query::<i64>(&mut con).unwrap(), 42);
    assert_eq!(cmd("DECRBY").arg("n").arg(2).query::<i64>(&mut con).unwrap(), 40);
    assert_eq!(cmd("DECR").arg("n").query::<i64>(&mut con).unwrap(), 39);
    cmd("MSET").arg("a").arg("1").arg("b").arg("2").query::<()>(&mut con).unwrap();
    assert_eq!(
        cmd("MGET").arg("a").arg("zz").arg("b").query::<Vec<Option<String>>>(&mut con).unwrap(),
        vec![Some("1".into()), None, Some("2".into())]
    );
    assert_eq!(cmd("DBSIZE").query::<i64>(&mut con).unwrap(), 3);

    let e = cmd("INCR").arg("a").arg("extra").query::<i64>(&mut con).unwrap_err();
    assert!(e.to_string().contains("wrong number of arguments for 'incr' command"), "{e}");
    cmd("SET").arg("s").arg("abc").query::<()>(&mut con).unwrap();
    let e = cmd("INCR").arg("s").query::<i64>(&mut con).unwrap_err();
    assert!(e.to_string().contains("value is not an integer or out of range"), "{e}");
    let e = cmd("SET").arg("s").arg("x").arg("PX").arg(0).query::<()>(&mut con).unwrap_err();
    assert!(e.to_string().contains("invalid expire time in 'set' command"), "{e}");
    cmd("SET").arg("s").arg("x").arg("PX").arg(600_000).query::<()>(&mut con).unwrap();
    let pttl = cmd("PTTL").arg("s").query::<i64>(&mut con).unwrap();
    assert!((1..=600_000).contains(&pttl), "{pttl}");
    let e = cmd("LPUSH").arg("l").arg("x").query::<i64>(&mut con).unwrap_err();
    assert!(e.to_string().contains("unknown command 'LPUSH', with args beginning with: 'l' 'x'"), "{e}");
    // The connection survives command errors.
    assert_eq!(cmd("ECHO").arg("still here").query::<String>(&mut con).unwrap(), "still here");
}

#[test]
fn pipelines_through_redis_rs() {
    let (server, store) = common::start(ServerOptions::default());
    let mut con = connect(&server);
    let mut pipe = redis::pipe();
    for i in 0..500 {
        pipe.cmd("SET").arg(format!("key:{i}")).arg(i).ignore();
    }
    for i in (0..500).step_by(50) {
        pipe.cmd("GET").arg(format!("key:{i}"));
    }
    pipe.cmd("INCRBY").arg("key:7").arg(1000);
    let (gets, incr): (Vec<i64>, i64) = {
        let mut all: Vec<redis::Value> = pipe.query(&mut con).unwrap();
        let incr: i64 = redis::from_redis_value(all.pop().unwrap()).unwrap();
        (all.into_iter().map(|v| redis::from_redis_value(v).unwrap()).collect(), incr)
    };
    assert_eq!(gets, (0..500).step_by(50).collect::<Vec<i64>>());
    assert_eq!(incr, 1007);
    assert_eq!(store.peek(b"key:499"), Some(b"499".to_vec()));
}

#[test]
fn concurrent_increments_are_not_lost() {
    let (server, store) = common::start(ServerOptions::default());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let mut con = connect(&server);
            std::thread::spawn(move || {
                for _ in 0..250 {
                    cmd("INCR").arg("counter").query::<i64>(&mut con).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(store.peek(b"counter"), Some(b"1000".to_vec()));
}

#[test]
fn client_names_through_redis_rs() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut con = connect(&server);
    cmd("CLIENT").arg("SETNAME").arg("loader-3").query::<()>(&mut con).unwrap();
    assert_eq!(cmd("CLIENT").arg("GETNAME").query::<String>(&mut con).unwrap(), "loader-3");
    let info: String = cmd("INFO").arg("clients").query(&mut con).unwrap();
    assert!(info.contains("connected_clients:1\r\n"), "{info}");
}

#[test]
fn clients_beyond_the_limit_are_refused_like_redis() {
    let options = ServerOptions { max_clients: 2, ..ServerOptions::default() };
    let (server, _store) = common::start(options);
    let mut first = connect(&server);
    let mut second = connect(&server);
    assert_eq!(cmd("PING").query::<String>(&mut second).unwrap(), "PONG");
    let mut third = common::raw(&server);
    let (reply, closed) = common::exchange(&mut third, b"PING\r\n", true, Duration::from_secs(5));
    assert_eq!(String::from_utf8_lossy(&reply), "-ERR max number of clients reached\r\n");
    assert!(closed);
    assert_eq!(server.stats().rejected_connections(), 1);
    assert_eq!(cmd("PING").query::<String>(&mut first).unwrap(), "PONG");
    drop(first);
    common::eventually("a slot frees up", || server.stats().connected_clients() == 1);
    let mut fourth = connect(&server);
    assert_eq!(cmd("PING").query::<String>(&mut fourth).unwrap(), "PONG");
}

#[test]
fn idle_connections_are_closed_and_busy_ones_kept() {
    let options = ServerOptions { idle_timeout: Some(Duration::from_millis(300)), ..ServerOptions::default() };
    let (server, _store) = common::start(options);
    let mut idle = common::raw(&server);
    let mut busy = connect(&server);
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(cmd("PING").query::<String>(&mut busy).unwrap(), "PONG");
    }
    let (got, closed) = common::read_until_close(&mut idle, Duration::from_secs(5));
    assert!(closed && got.is_empty(), "idle connection not closed: {got:?}");
}

#[test]
fn shutdown_closes_connections_and_stops_accepting() {
    let (mut server, _store) = common::start(ServerOptions::default());
    let addr = server.local_addr();
    let mut con = common::raw(&server);
    let (reply, _) = common::exchange(&mut con, b"PING\r\n", true, Duration::from_millis(300));
    assert_eq!(reply, b"+PONG\r\n");
    server.shutdown();
    let (rest, closed) = common::read_until_close(&mut con, Duration::from_secs(5));
    assert!(closed && rest.is_empty());
    assert_eq!(server.stats().connected_clients(), 0);
    assert!(std::net::TcpStream::connect(addr).is_err(), "still accepting after shutdown");
}
