// node-redis and ioredis, default settings, authenticating against a Redis server.
//
// usage: node auth_check.mjs PORT PASSWORD USER USER_PASSWORD [CA_FILE]
//
// Same server setup as auth_check.py. Prints `ok`.
import { readFileSync } from "node:fs";
import { createClient } from "redis";
import Redis from "ioredis";

const [port, password, user, userPassword, caFile] = process.argv.slice(2);
const tls = caFile ? { ca: readFileSync(caFile), rejectUnauthorized: true, checkServerIdentity: () => undefined } : undefined;

function fail(message) {
  console.error(message);
  process.exit(1);
}

// node-redis
async function nodeRedis(options) {
  const client = createClient({
    socket: { host: "127.0.0.1", port: Number(port), tls: Boolean(tls), ...(tls ?? {}), reconnectStrategy: false },
    ...options,
  });
  client.on("error", () => {});
  await client.connect();
  return client;
}

try {
  const c = await nodeRedis({ password: "wrong" });
  await c.ping();
  fail("node-redis: a wrong password was accepted");
} catch (e) {
  if (!String(e).includes("WRONGPASS")) fail(`node-redis: unexpected error ${e}`);
}
const admin = await nodeRedis({ password });
if ((await admin.set("cache:node", "from node")) !== "OK") fail("node-redis: SET");
if ((await admin.get("cache:node")) !== "from node") fail("node-redis: GET");
await admin.quit();
const alice = await nodeRedis({ username: user, password: userPassword });
if ((await alice.get("cache:node")) !== "from node") fail("node-redis: alice GET");
try {
  await alice.get("secret");
  fail("node-redis: a key outside the user's patterns was read");
} catch (e) {
  if (!String(e).includes("NOPERM")) fail(`node-redis: unexpected error ${e}`);
}
await alice.quit();

// ioredis
function ioredis(options) {
  return new Redis({ host: "127.0.0.1", port: Number(port), tls, lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null, ...options });
}
// ioredis says HELLO on connect; refused with NOAUTH, it reports that and closes.
const noPass = ioredis({});
let reported = "";
noPass.on("error", (e) => {
  reported += String(e);
});
try {
  await noPass.connect();
  await noPass.set("cache:x", "1");
  fail("ioredis: no password: the command ran");
} catch (e) {
  if (!(String(e) + reported).includes("NOAUTH")) fail(`ioredis: unexpected error ${e} ${reported}`);
}
noPass.disconnect();
const io = ioredis({ username: user, password: userPassword });
await io.connect();
if ((await io.set("cache:io", "from ioredis")) !== "OK") fail("ioredis: SET");
if ((await io.get("cache:io")) !== "from ioredis") fail("ioredis: GET");
try {
  await io.get("secret");
  fail("ioredis: a key outside the user's patterns was read");
} catch (e) {
  if (!String(e).includes("NOPERM")) fail(`ioredis: unexpected error ${e}`);
}
io.disconnect();
console.log("ok");
