// outbox-rs beside graphile-worker on the same PostgreSQL, interleaved in
// one run (issue 19's table). Both sides run as processes of their own:
// graphile-worker here (`node compare.mjs graphile-…`), outbox-rs as the
// `pg_worker` example (examples/pg_worker.rs). run.sh installs and builds
// both, then runs `node compare.mjs run`.
//
// Both sides run no-op handlers on unkeyed messages, with concurrency 100
// and batch (local queue) 100, as the issue tuned them; graphile-worker gets
// the batching its performance page recommends (local queue, completions
// and failures batched, a pool of 25). Figures:
//
// * drain: N messages enqueued before the workers start; rate = N over the
//   time from the first handled to the last, across one or two worker
//   processes; and the share of the machine's cores busy (/proc/stat: not
//   idle, not waiting for I/O) from the workers' start to the end of the
//   drain, the server's work included: what one process leaves for a
//   second to take;
// * latency: an application process commits one message per transaction,
//   open loop at RATE a second from 8 connections; the worker runs in
//   another process; commit returned → handler started, per message (the
//   first tenth dropped as warm-up), and the server's WAL flushes
//   (`pg_stat_wal.wal_sync`) over that run per message.
//
// Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test),
// PG_WORKER (the built example), ROUNDS (3), DRAIN_N (50000), RATE (500),
// LATENCY_N (5000); SIDES (e.g. `outbox`) runs one side only, ONLY=latency
// the latency figures only.

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { readFileSync, mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import pg from "pg";
import { run, runMigrations } from "graphile-worker";

const URL = process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/test";
const CONCURRENCY = 100;
const BATCH = 100;
const SCHEMA = "compare_outbox";

/** graphile-worker's batching settings (`GRAPHILE_TUNING`, JSON, to try
 * others). */
const GRAPHILE_TUNING = JSON.parse(
  process.env.GRAPHILE_TUNING ??
    JSON.stringify({ localQueue: { size: BATCH }, completeJobBatchDelay: 0, failJobBatchDelay: 0 }),
);

const nowUs = () => Math.round((performance.timeOrigin + performance.now()) * 1000);

// ---- graphile-worker's side (child processes) ----

/** A worker until stdin closes; prints `handled= first_us= last_us=`, or
 * writes `seq us` lines to `out` when given. */
async function graphileWorker(out) {
  const seen = [];
  const runner = await run({
    connectionString: URL,
    concurrency: CONCURRENCY,
    noHandleSignals: true,
    pollInterval: 2000,
    // Its own performance page's batching: a local queue, completions
    // and failures batched; a pool as in that page's configuration.
    maxPoolSize: 25,
    preset: { worker: GRAPHILE_TUNING },
    taskList: {
      noop: async (payload) => {
        seen.push([payload.s, nowUs()]);
      },
    },
  });
  console.log("ready");
  await new Promise((resolve) => {
    process.stdin.on("end", resolve);
    process.stdin.resume();
  });
  await runner.stop();
  report(seen, out);
}

function report(seen, out) {
  if (out) {
    writeFileSync(out, seen.map(([s, us]) => `${s} ${us}`).join("\n") + "\n");
  } else {
    const first = Math.min(...seen.map((s) => s[1]));
    const last = Math.max(...seen.map((s) => s[1]));
    console.log(`handled=${seen.length} first_us=${first} last_us=${last}`);
  }
}

/** The application: `n` transactions at `rate` a second from 8
 * connections, each `add_job` in its own transaction; writes `seq us`
 * (commit returned) to `out`. */
async function graphileProduce(rate, n, out) {
  const pool = new pg.Pool({ connectionString: URL, max: 8 });
  const commits = [];
  const start = performance.now() + 200;
  const tasks = [];
  for (let seq = 0; seq < n; seq++) {
    const at = start + (seq * 1000) / rate;
    const wait = at - performance.now();
    if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    tasks.push(
      (async () => {
        const c = await pool.connect();
        try {
          await c.query("BEGIN");
          await c.query("SELECT graphile_worker.add_job('noop', json_build_object('s', $1::int))", [seq]);
          await c.query("COMMIT");
          commits.push([seq, nowUs()]);
        } finally {
          c.release();
        }
      })(),
    );
  }
  await Promise.all(tasks);
  await pool.end();
  report(commits, out);
}

// ---- the driver ----

function child(cmd, args) {
  const p = spawn(cmd, args, { stdio: ["pipe", "pipe", "inherit"] });
  const lines = [];
  const waiters = [];
  createInterface({ input: p.stdout }).on("line", (l) => {
    lines.push(l);
    waiters.splice(0).forEach((w) => w());
  });
  const exited = new Promise((resolve, reject) =>
    p.on("exit", (code) => (code === 0 ? resolve() : reject(new Error(`${cmd} ${args.join(" ")}: exit ${code}`)))),
  );
  return {
    lines,
    exited,
    async line(re) {
      for (;;) {
        const found = lines.find((l) => re.test(l));
        if (found) return found;
        await new Promise((r) => waiters.push(r));
      }
    },
    close() {
      p.stdin.end();
    },
  };
}

const PG_WORKER = process.env.PG_WORKER ?? "../../target/release/examples/pg_worker";

/** The driver's one connection (opened on first use). */
let driverClient;
async function sql(text, params) {
  if (!driverClient) {
    driverClient = new pg.Client({ connectionString: URL });
    await driverClient.connect();
  }
  return driverClient.query(text, params);
}

/** Until `countSql` counts nothing, or `deadlineMs` has passed. */
async function untilEmpty(countSql, deadlineMs = 600000) {
  const deadline = Date.now() + deadlineMs;
  while (Date.now() < deadline) {
    const { rows } = await sql(countSql);
    if (Number(rows[0].n) === 0) return;
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** The machine's CPU time so far, idle and in all, from /proc/stat. */
function cpuTimes() {
  const f = readFileSync("/proc/stat", "utf8").split("\n")[0].trim().split(/\s+/).slice(1).map(Number);
  return { idle: f[3] + (f[4] ?? 0), all: f.reduce((a, b) => a + b, 0) };
}

/** The share of the machine's cores busy (not idle, not waiting for I/O)
 * between two readings of `cpuTimes`. */
function busy(from, to) {
  return 1 - (to.idle - from.idle) / (to.all - from.all);
}

function rate(outputs, n) {
  const parsed = outputs.map((l) =>
    Object.fromEntries(l.split(" ").map((kv) => kv.split("=")).map(([k, v]) => [k, Number(v)])),
  );
  const handled = parsed.reduce((a, p) => a + (p.handled || 0), 0);
  if (handled < n) throw new Error(`only ${handled} of ${n} handled`);
  const first = Math.min(...parsed.filter((p) => p.handled).map((p) => p.first_us));
  const last = Math.max(...parsed.filter((p) => p.handled).map((p) => p.last_us));
  return n / ((last - first) / 1e6);
}

/** graphile-worker's schema made anew, as outbox-rs gets a fresh schema
 * for every figure: a jobs table that kept the dead rows of earlier figures
 * would make it slower with every round. */
async function freshGraphile() {
  await sql("DROP SCHEMA IF EXISTS graphile_worker CASCADE");
  await runMigrations({ connectionString: URL });
}

async function graphileDrain(procs, n) {
  await freshGraphile();
  for (let s = 0; s < n; s += 1000) {
    await sql(
      "SELECT graphile_worker.add_jobs(array(SELECT ROW('noop', json_build_object('s', i), NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec FROM generate_series($1::int, $2::int) AS i))",
      [s, Math.min(s + 1000, n) - 1],
    );
  }
  const from = cpuTimes();
  const workers = Array.from({ length: procs }, () => child("node", ["compare.mjs", "graphile-worker"]));
  await untilEmpty("SELECT count(*) AS n FROM graphile_worker._private_jobs");
  const cores = busy(from, cpuTimes());
  workers.forEach((w) => w.close());
  await Promise.all(workers.map((w) => w.exited));
  return { rate: rate(await Promise.all(workers.map((w) => w.line(/^handled=/))), n), cores };
}

async function outboxDrain(procs, n, keep) {
  await sql(`DROP SCHEMA IF EXISTS ${SCHEMA} CASCADE`);
  await sql(`CREATE SCHEMA ${SCHEMA}`);
  const fill = child(PG_WORKER, ["fill", URL, SCHEMA, String(n)]);
  fill.close();
  await fill.exited;
  const from = cpuTimes();
  const workers = Array.from({ length: procs }, (_, i) =>
    child(PG_WORKER, ["drain", URL, SCHEMA, `compare-${i}`, String(BATCH), String(CONCURRENCY), String(keep)]),
  );
  await Promise.all(workers.map((w) => w.exited));
  const cores = busy(from, cpuTimes());
  return { rate: rate(await Promise.all(workers.map((w) => w.line(/^handled=/))), n), cores };
}

function latencies(commitsFile, handledFile, n) {
  const read = (f) => new Map(readFileSync(f, "utf8").trim().split("\n").map((l) => l.split(" ").map(Number)));
  const commits = read(commitsFile);
  const handled = read(handledFile);
  const out = [];
  for (let seq = Math.floor(n / 10); seq < n; seq++) {
    if (!handled.has(seq)) throw new Error(`message ${seq} was never handled`);
    out.push((handled.get(seq) - commits.get(seq)) / 1000);
  }
  out.sort((a, b) => a - b);
  const q = (p) => out[Math.min(out.length - 1, Math.floor(p * out.length))];
  return { p50: q(0.5), p99: q(0.99) };
}

async function latency(side, rateHz, n) {
  const dir = mkdtempSync(join(tmpdir(), "compare-"));
  const [commits, handled] = [join(dir, "commits"), join(dir, "handled")];
  let worker;
  let producer;
  if (side === "graphile") {
    await freshGraphile();
    worker = child("node", ["compare.mjs", "graphile-worker", handled]);
    await worker.line(/^ready$/);
    producer = child("node", ["compare.mjs", "graphile-produce", String(rateHz), String(n), commits]);
  } else {
    await sql(`DROP SCHEMA IF EXISTS ${SCHEMA} CASCADE`);
    await sql(`CREATE SCHEMA ${SCHEMA}`);
    const fill = child(PG_WORKER, ["fill", URL, SCHEMA, "0"]);
    fill.close();
    await fill.exited;
    worker = child(PG_WORKER, ["listen", URL, SCHEMA, "compare-listen", String(BATCH), String(CONCURRENCY), "true", handled]);
    await worker.line(/^ready$/);
    producer = child(PG_WORKER, ["produce", URL, SCHEMA, String(rateHz), String(n), "8", commits]);
  }
  const syncs = async () => Number((await sql("SELECT wal_sync FROM pg_stat_wal")).rows[0].wal_sync);
  const syncsBefore = await syncs();
  producer.close();
  await producer.exited;
  // Until the worker has handled the last message (or 30 s: then the
  // missing ones are named below).
  const table = side === "graphile" ? "graphile_worker._private_jobs" : `${SCHEMA}.outbox WHERE state = 'pending'`;
  await untilEmpty(`SELECT count(*) AS n FROM ${table}`, 30000);
  const flushes = ((await syncs()) - syncsBefore) / n;
  worker.close();
  await worker.exited;
  return { ...latencies(commits, handled, n), flushes };
}

const fmt = (xs, unit, digits = 1) => {
  const lo = Math.min(...xs);
  const hi = Math.max(...xs);
  const f = (x) => (unit === "k" ? (x / 1000).toFixed(digits) + "k" : x.toFixed(digits));
  return lo === hi ? f(lo) : `${f(lo)}–${f(hi)}`;
};

async function main() {
  const rounds = Number(process.env.ROUNDS ?? 3);
  const n = Number(process.env.DRAIN_N ?? 50000);
  const rateHz = Number(process.env.RATE ?? 500);
  const latencyN = Number(process.env.LATENCY_N ?? 5000);
  const rows = {};
  const add = (k, v) => (rows[k] ??= []).push(v);
  for (let r = 0; r < rounds; r++) {
    // Alternate which side goes first.
    const sides = (r % 2 === 0 ? ["outbox", "graphile"] : ["graphile", "outbox"]).filter(
      (s) => !process.env.SIDES || process.env.SIDES.split(",").includes(s),
    );
    for (const side of sides) {
      for (const procs of process.env.ONLY === "latency" ? [] : [1, 2]) {
        const drains =
          side === "graphile"
            ? [["graphile-worker", () => graphileDrain(procs, n)]]
            : [
                ["outbox-rs", () => outboxDrain(procs, n, true)],
                ["outbox-rs, keep_processed(false)", () => outboxDrain(procs, n, false)],
              ];
        for (const [worker, drain] of drains) {
          const d = await drain();
          add(`drain, ${procs} process(es) | ${worker}`, d.rate);
          add(`… the machine's cores busy meanwhile, ${procs} process(es) | ${worker}`, d.cores);
        }
      }
      const l = await latency(side, rateHz, latencyN);
      add(`latency p50 | ${side === "graphile" ? "graphile-worker" : "outbox-rs"}`, l.p50);
      add(`latency p99 | ${side === "graphile" ? "graphile-worker" : "outbox-rs"}`, l.p99);
      add(`WAL flushes per message in the latency run | ${side === "graphile" ? "graphile-worker" : "outbox-rs"}`, l.flushes);
      console.error(`round ${r + 1}, ${side}: done`);
    }
  }
  // Per round: two processes against one, each side.
  for (const worker of ["outbox-rs", "outbox-rs, keep_processed(false)", "graphile-worker"]) {
    const one = rows[`drain, 1 process(es) | ${worker}`];
    const two = rows[`drain, 2 process(es) | ${worker}`];
    if (one && two) rows[`drain, 2 processes ÷ 1 process, per round | ${worker}`] = two.map((t, i) => t / one[i]);
  }
  await driverClient?.end();
  console.log(`\n${rounds} interleaved rounds; drains of ${n}, latency at ${rateHz} msg/s over ${latencyN} (first tenth dropped)\n`);
  console.log(`graphile-worker's batching: ${JSON.stringify(GRAPHILE_TUNING)}\n`);
  console.log("| figure | worker | value (range over the rounds) |");
  console.log("|---|---|---|");
  for (const [k, xs] of Object.entries(rows)) {
    const [figure, worker] = k.split(" | ");
    const value = figure.includes("cores busy")
      ? `${fmt(xs.map((x) => x * 100), "", 0)} %`
      : figure.includes("÷")
      ? `${fmt(xs, "", 2)} ×`
      : figure.startsWith("drain")
      ? `${fmt(xs, "k")} msg/s`
      : figure.startsWith("WAL")
        ? fmt(xs, "", 2)
        : `${fmt(xs, "ms", 2)} ms`;
    console.log(`| ${figure} | ${worker} | ${value} |`);
  }
}

const [mode, ...rest] = process.argv.slice(2);
if (mode === "graphile-worker") await graphileWorker(rest[0]);
else if (mode === "graphile-produce") await graphileProduce(Number(rest[0]), Number(rest[1]), rest[2]);
else if (mode === "run") await main();
else {
  console.error("usage: node compare.mjs run (see run.sh)");
  process.exit(2);
}
