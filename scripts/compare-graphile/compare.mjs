// outbox-rs beside graphile-worker on the same PostgreSQL, interleaved in
// one run (docs/performance.md, "Against graphile-worker"). Both sides run
// as processes of their own: graphile-worker here (`node compare.mjs
// graphile-…`), outbox-rs as the `pg_worker` example (examples/pg_worker.rs).
// run.sh installs and builds both, then runs `node compare.mjs run`;
// capped.sh runs `node compare.mjs capped` (relays capped by cgroups).
//
// Both sides run no-op handlers on unkeyed messages, with concurrency 100
// and batch (local queue) 100; graphile-worker gets the batching its
// performance page recommends (local queue, completions and failures
// batched, a pool of 25). Figures:
//
// * drain: N messages enqueued, then every table of the side's schema
//   VACUUM ANALYZEd and a CHECKPOINT taken (a table in use has statistics:
//   this server runs with autovacuum off, and a planner without them takes
//   poor plans; COLD=1 adds labelled rows without this), then the workers
//   start; rate = N over the time from the first handled to the last,
//   across one or two worker processes; the share of the machine's cores
//   busy (/proc/stat: not idle, not waiting for I/O) from the workers'
//   start to the end of the drain, the server's work included;
// * the database's CPU per delivered message over the drain: user + system
//   time of the server's processes (/proc/<pid>/stat), by kind (the
//   workers' backends, autovacuum, the checkpointer, other background
//   processes; processes that exited counted through the postmaster's
//   cutime/cstime), the driver's own backend left out; plus the VACUUM of
//   the side's tables right after the drain (what the drain left for
//   autovacuum to clean);
// * latency: an application process commits one message per transaction,
//   open loop at RATE a second from 8 connections; the worker runs in
//   another process; commit returned → handler started, per message (the
//   first tenth dropped as warm-up), and the server's WAL flushes
//   (`pg_stat_wal.wal_sync`) over that run per message.
//
// Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test),
// PG_WORKER (the built example), ROUNDS (3), DRAIN_N (50000), RATE (500),
// LATENCY_N (5000), COLD (1: the cold rows too); SIDES (e.g. `outbox`)
// runs one side only, ONLY=latency the latency figures only. `capped`:
// CAP (0.2), PROCS (1,2,4), KEEP_PROCESSED (true).

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { existsSync, mkdirSync, readFileSync, readdirSync, mkdtempSync, writeFileSync } from "node:fs";
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

// ---- the database's CPU (issue 53) ----

const CLK_TCK = 100; // `getconf CLK_TCK` on Linux/x86-64

/** The server's processes now: pid → { kind, ticks } (user + system,
 * clock ticks), and the postmaster's reaped children's ticks (`cutime` +
 * `cstime`: the processes that already exited). `kind` is from the process
 * title: backend (a client's connection), autovacuum, checkpointer,
 * postmaster (which forks every new connection's process), or other
 * (background writer, WAL writer, launchers). `skip` is a pid left
 * out (the driver's own backend). */
function serverProcs(postmaster, skip) {
  const procs = new Map();
  let reaped = 0;
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    let stat;
    try {
      stat = readFileSync(`/proc/${d}/stat`, "utf8");
    } catch {
      continue; // exited meanwhile
    }
    const close = stat.lastIndexOf(")");
    if (stat.slice(stat.indexOf("(") + 1, close) !== "postgres") continue;
    // After the comm: state ppid … utime(14) stime(15) cutime(16) cstime(17).
    const f = stat.slice(close + 2).split(" ");
    const pid = Number(d);
    const ticks = Number(f[11]) + Number(f[12]);
    if (pid === postmaster) {
      reaped = Number(f[13]) + Number(f[14]);
      procs.set(pid, { kind: "postmaster", ticks });
      continue;
    }
    if (pid === skip || Number(f[1]) !== postmaster) continue;
    let title = "";
    try {
      title = readFileSync(`/proc/${d}/cmdline`, "utf8");
    } catch {
      continue;
    }
    // A process that has exited but is not yet reaped (a zombie) has no
    // title: its kind is the one it had (`null` here, see serverCpu).
    const kind = title === ""
      ? null
      : /autovacuum/.test(title)
      ? "autovacuum"
      : /checkpointer/.test(title)
        ? "checkpointer"
        : /\d+\.\d+\.\d+\.\d+\(\d+\)|\[local\]/.test(title)
          ? "backend"
          : "other";
    procs.set(pid, { kind, ticks });
  }
  return { procs, reaped };
}

/** The server's postmaster pid and the driver's own backend, read once. */
let serverPids;
async function pids() {
  if (!serverPids) {
    const dir = (await sql("SHOW data_directory")).rows[0].data_directory;
    const postmaster = Number(readFileSync(join(dir, "postmaster.pid"), "utf8").split("\n")[0]);
    const own = (await sql("SELECT pg_backend_pid() AS pid")).rows[0].pid;
    serverPids = { postmaster, own };
  }
  return serverPids;
}

/** A reading of the server's CPU over a window: `sample()` while it runs
 * (so that a process that exits is attributed by its kind up to its last
 * sample), `done()` at its end → ticks by kind, `exited` being what the
 * exited processes spent after their last sample (and the processes born
 * and gone between two samples). Returns null where /proc shows no server
 * (a server on another machine or in a container). */
async function serverCpu() {
  const { postmaster, own } = await pids();
  const first = serverProcs(postmaster, own);
  if (first.procs.size === 0) return null;
  const start = new Map([...first.procs].map(([pid, p]) => [pid, p.ticks]));
  const last = new Map([...first.procs].map(([pid, p]) => [pid, { ...p, kind: p.kind ?? "backend" }]));
  // The kind a process was last seen with, for a zombie's reading.
  const kindOf = (pid, p) => ({ ...p, kind: p.kind ?? last.get(pid)?.kind ?? "backend" });
  const sample = () => {
    for (const [pid, p] of serverProcs(postmaster, own).procs) last.set(pid, kindOf(pid, p));
  };
  const done = () => {
    const end = serverProcs(postmaster, own);
    const by = { backend: 0, autovacuum: 0, checkpointer: 0, postmaster: 0, other: 0, exited: 0 };
    let gone = 0;
    for (const [pid, p] of last) {
      const now = end.procs.has(pid) ? kindOf(pid, end.procs.get(pid)) : undefined;
      const spent = (now ?? p).ticks - (start.get(pid) ?? 0);
      by[(now ?? p).kind] += spent;
      // The postmaster's reaped ticks count a process's whole life.
      if (!now) gone += p.ticks;
    }
    by.exited = Math.max(0, end.reaped - first.reaped - gone);
    return by;
  };
  return { sample, done };
}

/** The same reading over the driver's own statement (the VACUUM after a
 * drain): the driver's backend's ticks before and after. */
async function ownTicks() {
  const { own } = await pids();
  const f = readFileSync(`/proc/${own}/stat`, "utf8");
  const g = f.slice(f.lastIndexOf(")") + 2).split(" ");
  return Number(g[11]) + Number(g[12]);
}

/** µs of server CPU per message from ticks. */
const perMessage = (ticks, n) => (ticks * 1e6) / CLK_TCK / n;

/** Every table of `schema`, VACUUM ANALYZEd, then a CHECKPOINT: the state a
 * table in use is in (statistics, a visibility map, no dirty pages left for
 * the drain to write). This server runs with `autovacuum = off` (the
 * machine's conf.d), so nothing else would analyse a freshly filled table;
 * on a server with autovacuum on, the fill alone would have triggered an
 * ANALYZE. */
async function prepare(schema) {
  const { rows } = await sql(
    "SELECT format('%I.%I', schemaname, tablename) AS t FROM pg_tables WHERE schemaname = $1",
    [schema],
  );
  for (const { t } of rows) await sql(`VACUUM ANALYZE ${t}`);
  await sql("CHECKPOINT");
}

/** VACUUM of every table of `schema` after a drain, timed on the driver's
 * backend: the cleanup of what the drain left (dead tuples), which
 * autovacuum would do later on a production server. Returns ticks. */
async function cleanup(schema) {
  const before = await ownTicks();
  const { rows } = await sql(
    "SELECT format('%I.%I', schemaname, tablename) AS t FROM pg_tables WHERE schemaname = $1",
    [schema],
  );
  // No parallel workers: they would be processes of their own, outside
  // this reading.
  for (const { t } of rows) await sql(`VACUUM (PARALLEL 0) ${t}`);
  return (await ownTicks()) - before;
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

/** A drain of `n` already-enqueued messages by the worker processes
 * `start()` spawns, until `finished` (given the workers) resolves: the
 * rate, the machine's cores busy, and the server's CPU per message by kind
 * over the drain, plus the VACUUM of `schema` that follows it. Unless
 * `cold`, `schema`'s tables are VACUUM ANALYZEd and a CHECKPOINT taken
 * first, as a table in use is. */
async function measuredDrain(schema, n, cold, start, finished) {
  if (!cold) await prepare(schema);
  const cpu = await serverCpu();
  const from = cpuTimes();
  const workers = start();
  const sampler = cpu && setInterval(cpu.sample, 50);
  await finished(workers);
  const cores = busy(from, cpuTimes());
  if (sampler) clearInterval(sampler);
  const server = cpu?.done();
  workers.forEach((w) => w.close());
  await Promise.all(workers.map((w) => w.exited));
  const vacuum = cpu ? await cleanup(schema) : null;
  const lines = await Promise.all(workers.map((w) => w.line(/^handled=/)));
  const rateNow = rate(lines, n);
  const shares = lines.map((l) => Number(/handled=(\d+)/.exec(l)[1]) / n);
  const db =
    server &&
    Object.fromEntries([...Object.entries(server), ["vacuum after", vacuum]].map(([k, t]) => [k, perMessage(t, n)]));
  return { rate: rateNow, cores, db, shares };
}

async function graphileDrain(procs, n, cold) {
  await freshGraphile();
  for (let s = 0; s < n; s += 1000) {
    await sql(
      "SELECT graphile_worker.add_jobs(array(SELECT ROW('noop', json_build_object('s', i), NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec FROM generate_series($1::int, $2::int) AS i))",
      [s, Math.min(s + 1000, n) - 1],
    );
  }
  return measuredDrain(
    "graphile_worker",
    n,
    cold,
    () => Array.from({ length: procs }, () => child("node", ["compare.mjs", "graphile-worker"])),
    () => untilEmpty("SELECT count(*) AS n FROM graphile_worker._private_jobs"),
  );
}

/** `cap` (a share of one core, or 0): each worker process in a cgroup (v1
 * `cpu`) of its own with that CPU quota. */
async function outboxDrain(procs, n, keep, cold, cap = 0) {
  await sql(`DROP SCHEMA IF EXISTS ${SCHEMA} CASCADE`);
  await sql(`CREATE SCHEMA ${SCHEMA}`);
  const fill = child(PG_WORKER, ["fill", URL, SCHEMA, String(n)]);
  fill.close();
  await fill.exited;
  const argsOf = (i) => ["drain", URL, SCHEMA, `compare-${i}`, String(BATCH), String(CONCURRENCY), String(keep)];
  return measuredDrain(
    SCHEMA,
    n,
    cold,
    () =>
      Array.from({ length: procs }, (_, i) =>
        cap ? capped(i, cap, PG_WORKER, argsOf(i)) : child(PG_WORKER, argsOf(i)),
      ),
    (workers) => Promise.all(workers.map((w) => w.exited)),
  );
}

const CGROUP = "/sys/fs/cgroup/cpu";

/** `cmd args` in the cgroup `outbox-capped-<i>` (made if absent) with
 * `share` of one core (`cpu.cfs_quota_us` over a 100 ms period); the
 * shell joins the group before it execs the worker, so all of its work is
 * capped. */
function capped(i, share, cmd, args) {
  const group = join(CGROUP, `outbox-capped-${i}`);
  mkdirSync(group, { recursive: true });
  writeFileSync(join(group, "cpu.cfs_period_us"), "100000");
  writeFileSync(join(group, "cpu.cfs_quota_us"), String(Math.round(share * 100000)));
  const quoted = [cmd, ...args].map((a) => `'${a.replaceAll("'", "'\\''")}'`).join(" ");
  return child("sh", ["-c", `echo $$ > ${join(group, "cgroup.procs")} && exec ${quoted}`]);
}

/** Says clearly why capped relays cannot run here, or nothing. */
function cannotCap() {
  if (process.getuid?.() !== 0) return "capped relays need root (they write cgroup files)";
  if (!existsSync(join(CGROUP, "cpu.cfs_quota_us")))
    return `capped relays need the cgroup v1 cpu controller at ${CGROUP} (cpu.cfs_quota_us); this machine has none`;
  return null;
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

/** The figures of a run: figure → worker → values over the rounds, each
 * figure with its unit (how `print` shows the range). */
class Figures {
  rows = new Map();
  add(figure, worker, value, unit) {
    const key = `${figure} | ${worker}`;
    if (!this.rows.has(key)) this.rows.set(key, { figure, worker, unit, xs: [] });
    this.rows.get(key).xs.push(value);
  }
  /** The database's CPU per message of a drain, in all and by kind. */
  addDb(label, worker, db) {
    if (!db) return;
    const all = Object.values(db).reduce((a, b) => a + b, 0);
    this.add(`the database's CPU per message, ${label}`, worker, all, "µs");
    for (const [kind, what] of [
      ["backend", "the workers' backends"],
      ["vacuum after", "the VACUUM after the drain"],
      ["autovacuum", "autovacuum"],
      ["checkpointer", "the checkpointer"],
      ["postmaster", "the postmaster (forking connections)"],
      ["other", "other background processes (WAL writer, background writer)"],
      ["exited", "exited processes after their last sample (mostly backends closing)"],
    ])
      this.add(`… of which ${what}, ${label}`, worker, db[kind], "µs");
  }
  get(figure, worker) {
    return this.rows.get(`${figure} | ${worker}`)?.xs;
  }
  print() {
    const range = (xs, f) => {
      const [lo, hi] = [Math.min(...xs), Math.max(...xs)];
      return lo === hi ? f(lo) : `${f(lo)}–${f(hi)}`;
    };
    const show = {
      "msg/s": (xs) => `${range(xs, (x) => (x / 1000).toFixed(1) + "k")} msg/s`,
      "%": (xs) => `${range(xs, (x) => (x * 100).toFixed(0))} %`,
      "×": (xs) => `${range(xs, (x) => x.toFixed(2))} ×`,
      ms: (xs) => `${range(xs, (x) => x.toFixed(2))} ms`,
      µs: (xs) => `${range(xs, (x) => x.toFixed(1))} µs`,
      "": (xs) => range(xs, (x) => x.toFixed(2)),
      text: (xs) => xs.join("; "),
    };
    console.log("| figure | worker | value (range over the rounds) |");
    console.log("|---|---|---|");
    for (const { figure, worker, unit, xs } of this.rows.values()) {
      // A part of the database's CPU that was nothing in every round.
      if (figure.startsWith("… of which") && xs.every((x) => x === 0)) continue;
      console.log(`| ${figure} | ${worker} | ${show[unit](xs)} |`);
    }
  }
}

async function main() {
  const rounds = Number(process.env.ROUNDS ?? 3);
  const n = Number(process.env.DRAIN_N ?? 50000);
  const rateHz = Number(process.env.RATE ?? 500);
  const latencyN = Number(process.env.LATENCY_N ?? 5000);
  // COLD=1: each drain also without the VACUUM ANALYZE and CHECKPOINT
  // after the fill, as a second, labelled row.
  const preparations = process.env.COLD === "1" ? [false, true] : [false];
  const figures = new Figures();
  for (let r = 0; r < rounds; r++) {
    // Alternate which side goes first.
    const sides = (r % 2 === 0 ? ["outbox", "graphile"] : ["graphile", "outbox"]).filter(
      (s) => !process.env.SIDES || process.env.SIDES.split(",").includes(s),
    );
    for (const side of sides) {
      for (const procs of process.env.ONLY === "latency" ? [] : [1, 2]) {
        for (const cold of preparations) {
          const drains =
            side === "graphile"
              ? [["graphile-worker", () => graphileDrain(procs, n, cold)]]
              : [
                  ["outbox-rs", () => outboxDrain(procs, n, true, cold)],
                  ["outbox-rs, keep_processed(false)", () => outboxDrain(procs, n, false, cold)],
                ];
          const label = `${procs} process(es)${cold ? ", cold (no statistics, no checkpoint)" : ""}`;
          for (const [worker, drain] of drains) {
            const d = await drain();
            figures.add(`drain, ${label}`, worker, d.rate, "msg/s");
            figures.add(`… the machine's cores busy meanwhile, ${label}`, worker, d.cores, "%");
            figures.addDb(label, worker, d.db);
          }
        }
      }
      const worker = side === "graphile" ? "graphile-worker" : "outbox-rs";
      const l = await latency(side, rateHz, latencyN);
      figures.add("latency p50", worker, l.p50, "ms");
      figures.add("latency p99", worker, l.p99, "ms");
      figures.add("WAL flushes per message in the latency run", worker, l.flushes, "");
      console.error(`round ${r + 1}, ${side}: done`);
    }
  }
  // Per round: two processes against one, each side.
  for (const worker of ["outbox-rs", "outbox-rs, keep_processed(false)", "graphile-worker"]) {
    const one = figures.get("drain, 1 process(es)", worker);
    const two = figures.get("drain, 2 process(es)", worker);
    if (one && two)
      two.forEach((t, i) => figures.add("drain, 2 processes ÷ 1 process, per round", worker, t / one[i], "×"));
  }
  await driverClient?.end();
  console.log(`\n${rounds} interleaved rounds; drains of ${n}, latency at ${rateHz} msg/s over ${latencyN} (first tenth dropped)\n`);
  console.log(`graphile-worker's batching: ${JSON.stringify(GRAPHILE_TUNING)}`);
  console.log(
    "Each drain's tables VACUUM ANALYZEd and a CHECKPOINT taken after the fill" +
      (preparations.length > 1 ? " (the cold rows: neither)" : "") +
      "; the database's CPU from /proc/<pid>/stat of the server's processes over the drain, the driver's own backend left out, plus the VACUUM that follows.\n",
  );
  figures.print();
}

/** outbox-rs relays each capped to `CAP` (0.2) of a core, 1, 2 and 4 of
 * them (`PROCS`), draining `DRAIN_N` in `ROUNDS` rounds: msg/s, each
 * relay's share of the messages, the machine's cores busy and the
 * database's CPU per message — claim contention apart from the relays'
 * CPU, the server being the only uncapped side. */
async function cappedMain() {
  const why = cannotCap();
  if (why) {
    console.error(`compare.mjs capped: ${why}`);
    process.exit(2);
  }
  const rounds = Number(process.env.ROUNDS ?? 2);
  const n = Number(process.env.DRAIN_N ?? 50000);
  const cap = Number(process.env.CAP ?? 0.2);
  const counts = (process.env.PROCS ?? "1,2,4").split(",").map(Number);
  const keep = process.env.KEEP_PROCESSED !== "false";
  const worker = keep ? "outbox-rs" : "outbox-rs, keep_processed(false)";
  const figures = new Figures();
  for (let r = 0; r < rounds; r++) {
    for (const procs of r % 2 === 0 ? counts : [...counts].reverse()) {
      const d = await outboxDrain(procs, n, keep, false, cap);
      const label = `${procs} relay(s) capped to ${cap} core each`;
      figures.add(`drain, ${label}`, worker, d.rate, "msg/s");
      figures.add(
        `… each relay's share of the messages, ${label}`,
        worker,
        d.shares.map((x) => x.toFixed(2)).join(" / "),
        "text",
      );
      figures.add(`… the machine's cores busy meanwhile, ${label}`, worker, d.cores, "%");
      figures.addDb(label, worker, d.db);
      console.error(`round ${r + 1}, ${procs} relay(s): done`);
    }
  }
  await driverClient?.end();
  console.log(`\n${rounds} rounds; drains of ${n}; each relay process in a cgroup of its own, cpu.cfs_quota_us = ${cap} of cpu.cfs_period_us\n`);
  figures.print();
}

const [mode, ...rest] = process.argv.slice(2);
if (mode === "graphile-worker") await graphileWorker(rest[0]);
else if (mode === "graphile-produce") await graphileProduce(Number(rest[0]), Number(rest[1]), rest[2]);
else if (mode === "run") await main();
else if (mode === "capped") await cappedMain();
else {
  console.error("usage: node compare.mjs run|capped (see run.sh, capped.sh)");
  process.exit(2);
}
