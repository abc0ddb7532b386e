// What applications do with node-redis and ioredis, default settings, against one server.
// Run against racekv and against a real redis-server as the control (see compat.py).
//
// usage: node compat.mjs PORT
// Prints `PASS name` or `FAIL name: why` per scenario; exits 1 if any failed.
// Keys live under `compat:node:` and `compat:io:` and are deleted first.
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { createClient } from "redis";
import Redis from "ioredis";

const port = Number(process.argv[2]);

// ---- node-redis ----
async function nodeRedisScenarios() {
  const k = (name) => `compat:node:${name}`;
  const client = createClient({ socket: { host: "127.0.0.1", port } });
  client.on("error", () => {});
  await client.connect();
  for await (const keys of client.scanIterator({ MATCH: k("*"), COUNT: 1000 })) {
    for (const key of [].concat(keys)) await client.del(key);
  }
  const scenarios = {
    async cacheWithTtls() {
      assert.equal(await client.get(k("user")), null);
      assert.equal(await client.set(k("user"), JSON.stringify({ id: 1 }), { EX: 60 }), "OK");
      assert.equal(JSON.parse(await client.get(k("user"))).id, 1);
      const ttl = await client.ttl(k("user"));
      assert.ok(ttl > 0 && ttl <= 60, `ttl ${ttl}`);
      await client.set(k("short"), "x", { PX: 300 });
      await sleep(600);
      assert.equal(await client.get(k("short")), null, "an expired entry was returned");
    },
    async rateLimiter() {
      const key = k("rate");
      const counts = [];
      for (let i = 0; i < 5; i++) {
        const [count] = await client.multi().incr(key).expire(key, 60, "NX").execAsPipeline();
        counts.push(count);
      }
      assert.deepEqual(counts, [1, 2, 3, 4, 5]);
      const ttl = await client.ttl(key);
      assert.ok(ttl > 0 && ttl <= 60, `ttl ${ttl}`);
    },
    async bulkMgetMset() {
      const entries = Array.from({ length: 300 }, (_, i) => [k(`bulk:${i}`), `value-${i}`]);
      assert.equal(await client.mSet(entries), "OK");
      const got = await client.mGet([...entries.map(([key]) => key), k("missing")]);
      assert.deepEqual(got.slice(0, 300), entries.map(([, v]) => v));
      assert.equal(got[300], null);
      assert.equal(await client.del(entries.map(([key]) => key)), 300);
    },
    async scanIteration() {
      const keys = new Set(Array.from({ length: 200 }, (_, i) => k(`scan:${i}`)));
      await Promise.all([...keys].map((key) => client.set(key, "1")));
      const seen = new Set();
      for await (const page of client.scanIterator({ MATCH: k("scan:*"), COUNT: 50 })) {
        for (const key of [].concat(page)) seen.add(key);
      }
      assert.deepEqual([...seen].sort(), [...keys].sort());
      assert.equal(await client.unlink([...keys]), 200);
    },
    async binaryValues() {
      // node-redis decodes replies as text by default: the stored length tells the bytes
      // arrived whole.
      const value = Buffer.from(Array.from({ length: 256 }, (_, i) => 255 - i));
      await client.set(k("bin"), value);
      assert.equal(await client.strLen(k("bin")), 256);
      assert.equal(await client.append(k("bin"), Buffer.from([0, 13, 10])), 259);
    },
    async largeValues() {
      for (const size of [1 << 20, 100 << 20]) {
        await client.set(k("big"), Buffer.alloc(size, 0x61));
        assert.equal(await client.strLen(k("big")), size);
        const got = await client.get(k("big"));
        assert.equal(got.length, size);
        assert.ok(got === "a".repeat(size), `${size} B came back different`);
      }
      await client.del(k("big"));
    },
  };
  const results = [];
  for (const [name, run] of Object.entries(scenarios)) {
    try {
      await run();
      results.push(`PASS node-redis.${name}`);
    } catch (e) {
      results.push(`FAIL node-redis.${name}: ${e.message}`);
    }
  }
  await client.quit();
  return results;
}

// ---- ioredis ----
async function ioredisScenarios() {
  const k = (name) => `compat:io:${name}`;
  const r = new Redis({ host: "127.0.0.1", port, lazyConnect: true });
  r.on("error", () => {});
  await r.connect();
  const old = await r.keys(k("*"));
  if (old.length) await r.del(...old);
  const scenarios = {
    async cacheWithTtls() {
      assert.equal(await r.set(k("user"), "ada", "EX", 60), "OK");
      assert.equal(await r.get(k("user")), "ada");
      assert.ok((await r.ttl(k("user"))) > 0);
      assert.equal(await r.set(k("lock"), "1", "PX", 30000, "NX"), "OK");
      assert.equal(await r.set(k("lock"), "2", "PX", 30000, "NX"), null);
    },
    async rateLimiter() {
      const key = k("rate");
      const counts = [];
      for (let i = 0; i < 5; i++) {
        const [[, count]] = await r.pipeline().incr(key).expire(key, 60).exec();
        counts.push(count);
      }
      assert.deepEqual(counts, [1, 2, 3, 4, 5]);
    },
    async bulkMgetMset() {
      const flat = [];
      for (let i = 0; i < 300; i++) flat.push(k(`bulk:${i}`), `value-${i}`);
      assert.equal(await r.mset(...flat), "OK");
      const got = await r.mget(...flat.filter((_, i) => i % 2 === 0));
      assert.deepEqual(got, flat.filter((_, i) => i % 2 === 1));
    },
    async scanStream() {
      const keys = Array.from({ length: 200 }, (_, i) => k(`scan:${i}`));
      await r.mset(...keys.flatMap((key) => [key, "1"]));
      const seen = new Set();
      await new Promise((resolve, reject) => {
        const stream = r.scanStream({ match: k("scan:*"), count: 50 });
        stream.on("data", (page) => page.forEach((key) => seen.add(key)));
        stream.on("end", resolve);
        stream.on("error", reject);
      });
      assert.deepEqual([...seen].sort(), [...keys].sort());
    },
    async binaryValues() {
      const value = Buffer.from(Array.from({ length: 256 }, (_, i) => i));
      await r.set(k("bin"), value);
      assert.deepEqual(await r.getBuffer(k("bin")), value);
    },
    async largeValues() {
      for (const size of [1 << 20, 100 << 20]) {
        const value = Buffer.alloc(size);
        for (let i = 0; i < size; i += 4096) value.writeUInt32LE(i, i);
        assert.equal(await r.set(k("big"), value), "OK");
        assert.ok(value.equals(await r.getBuffer(k("big"))), `${size} B came back different`);
      }
      await r.del(k("big"));
    },
  };
  const results = [];
  for (const [name, run] of Object.entries(scenarios)) {
    try {
      await run();
      results.push(`PASS ioredis.${name}`);
    } catch (e) {
      results.push(`FAIL ioredis.${name}: ${e.message}`);
    }
  }
  r.disconnect();
  return results;
}

const results = [...(await nodeRedisScenarios()), ...(await ioredisScenarios())];
for (const line of results) console.log(line);
process.exit(results.some((line) => line.startsWith("FAIL")) ? 1 : 0);
