//! Many threads on several attached clients, every reply checked against its request.

use racekv_client::Client;

use super::super::AttachOptions;
use super::Harness;

fn value_of(key: &str, i: usize) -> Vec<u8> {
    format!("{key}={}", "v".repeat(i % 97)).into_bytes()
}

#[test]
fn many_threads_on_several_clients_each_get_their_own_replies() {
    // Few slots, so threads outnumber them and wait for slots too.
    let h = Harness::with(1024, 3, AttachOptions { slots: 8, slot_bytes: 40 << 10, ..AttachOptions::default() });
    let clients: Vec<Client> = (0..3).map(|_| h.client()).collect();
    const THREADS: usize = 6;
    const OPS: usize = 150;
    std::thread::scope(|s| {
        for (ci, client) in clients.iter().enumerate() {
            for t in 0..THREADS {
                s.spawn(move || {
                    let mut mine: Vec<String> = Vec::new();
                    for i in 0..OPS {
                        let key = format!("c{ci}-t{t}-{i}");
                        let value = value_of(&key, i);
                        client.put(key.as_bytes(), &value).unwrap();
                        assert_eq!(client.get(key.as_bytes()).unwrap(), Some(value), "{key}");
                        if i % 7 == 3 {
                            assert!(client.delete(key.as_bytes()).unwrap());
                            assert_eq!(client.get(key.as_bytes()).unwrap(), None);
                        }
                        mine.push(key);
                        if i % 10 == 9 {
                            let recent: Vec<&[u8]> = mine[mine.len() - 10..].iter().map(|k| k.as_bytes()).collect();
                            let values = client.multi_get(&recent).unwrap();
                            for (j, v) in values.into_iter().enumerate() {
                                let n = mine.len() - 10 + j;
                                let expected = (n % 7 != 3).then(|| value_of(&mine[n], n));
                                assert_eq!(v, expected, "{}", mine[n]);
                            }
                        }
                    }
                });
            }
        }
    });
    // Everything is where the threads left it, as an embedded client sees the table.
    let embedded = h.embedded();
    for ci in 0..3 {
        for t in 0..THREADS {
            let keys: Vec<String> = (0..OPS).map(|i| format!("c{ci}-t{t}-{i}")).collect();
            let asked: Vec<&[u8]> = keys.iter().map(String::as_bytes).collect();
            for (i, v) in embedded.multi_get(&asked).unwrap().into_iter().enumerate() {
                assert_eq!(v, (i % 7 != 3).then(|| value_of(&keys[i], i)), "{}", keys[i]);
            }
        }
    }
}
