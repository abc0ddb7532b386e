"""redis-py, default settings (RESP3 since 8.0), authenticating against a Redis server.

usage: auth_check.py PORT PASSWORD USER USER_PASSWORD [CA_FILE]

The server must have `default` with PASSWORD and USER with USER_PASSWORD allowed only keys
`cache:*` (read and write). With CA_FILE, connects over TLS trusting it. Prints `ok`.
"""
import sys

import redis

port, password, user, user_password = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
tls = {"ssl": True, "ssl_ca_certs": sys.argv[5], "ssl_check_hostname": False} if len(sys.argv) > 5 else {}


def client(**kwargs):
    return redis.Redis(host="127.0.0.1", port=port, **tls, **kwargs)


try:
    client().set("cache:x", "1")
    raise SystemExit("no password: the command ran")
except redis.exceptions.AuthenticationError:
    pass

try:
    client(password="wrong").ping()
    raise SystemExit("a wrong password was accepted")
except redis.exceptions.AuthenticationError:
    pass

admin = client(password=password)
assert admin.set("cache:py", "from python") is True
assert admin.get("cache:py") == b"from python"

alice = client(username=user, password=user_password)
assert alice.get("cache:py") == b"from python"
assert alice.set("cache:alice", "mine") is True
try:
    alice.get("secret")
    raise SystemExit("a key outside the user's patterns was read")
except redis.exceptions.NoPermissionError:
    pass
with alice.pipeline(transaction=False) as pipe:
    pipe.set("cache:p1", "a").get("cache:p1")
    assert pipe.execute() == [True, b"a"]
print("ok")
