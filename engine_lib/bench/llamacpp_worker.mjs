// The process that runs llama.cpp for the bench, through node-llama-cpp:
//   node llamacpp_worker.mjs FILE.gguf THREADS CTX [lookup]     (or: node llamacpp_worker.mjs --check)
//
// Defined for chapter 08 (results); engine_lib/bench/llamacpp.py starts it and talks to it. It runs
// in a process of its own so that its peak memory (the process's peak RSS, VmHWM) is llama.cpp's
// alone. node-llama-cpp is found in ENGINE_LIB_NODE_LLAMA_CPP/node_modules (llamacpp.py sets it).
//
// Protocol: one JSON object per line on stdin, one JSON answer per line on stdout (llama.cpp's
// own logging goes to stderr). Requests:
//   {"op": "generate", "prompt": [ids], "n": N}: greedy, N new tokens, no early stop ->
//     ttft_s (prompt in -> first token out), decode_tok_s ((N - 1) / the time after it), tokens, and
//     predictions (this request's drafts, validated and refuted: with "lookup", the sequence drafts with
//     node-llama-cpp's InputLookupTokenPredictor, prompt lookup over the request's prompt, at its defaults);
//   {"op": "logprobs", "prompt": [ids], "n_vocab": V, "out": "x.f32", "steps": true}: the log-probabilities of
//     the next token, float32 written raw to out: at every position, one token per evaluation
//     (steps: the decode path), (len(prompt), V); or the whole prompt in one batch (the prefill
//     path), the last position's only, (1, V);
//   {"op": "memory"}: this process's peak_rss_bytes and rss_bytes;
//   {"op": "quit"}.
import fs from "node:fs";
import path from "node:path";
import readline from "node:readline";
import {pathToFileURL} from "node:url";

function rss(field) {
    const line = fs.readFileSync("/proc/self/status", "utf8").split("\n").find((l) => l.startsWith(field + ":"));
    return line ? Number(line.split(/\s+/)[1]) * 1024 : null;
}

async function binding() {
    // an ES module cannot be found through NODE_PATH: import the package's entry file by its path
    const dir = path.join(process.env.ENGINE_LIB_NODE_LLAMA_CPP || process.cwd(), "node_modules", "node-llama-cpp");
    const pkg = JSON.parse(fs.readFileSync(path.join(dir, "package.json"), "utf8"));
    const mod = await import(pathToFileURL(path.join(dir, pkg.exports["."].import)).href);
    return {mod, version: pkg.version};
}

const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

async function main(argv) {
    let lib;
    try {
        lib = await binding();
    } catch (err) {
        say({error: `node-llama-cpp not found: ${err.message}`.slice(0, 500)});
        return 1;
    }
    if (argv[0] === "--check") {
        say({ok: true, node_llama_cpp: lib.version, node: process.version});
        return 0;
    }
    const [file, threads, nCtx, lookup] = [argv[0], Number(argv[1]), Number(argv[2]), argv[3] === "lookup"];
    const base = rss("VmRSS");
    const t0 = performance.now();
    let llama, model, context, seq;
    try {
        // the prebuilt CPU binary, never a compile; llama.cpp's log to stderr, clear of the protocol
        llama = await lib.mod.getLlama({gpu: false, build: "never", logLevel: "warn",
                                        logger: (level, message) => process.stderr.write(`[${level}] ${message}\n`)});
        model = await llama.loadModel({modelPath: file});
        // flash attention: llama.cpp's own default ("auto") turns it on for the CPU
        context = await model.createContext({contextSize: nCtx, threads, batchSize: 512, flashAttention: true});
        seq = context.getSequence(lookup ? {tokenPredictor: new lib.mod.InputLookupTokenPredictor()} : {});
    } catch (err) {
        say({error: `${err.name}: ${err.message}`.slice(0, 500)});
        return 1;
    }
    say({ready: true, lookup, load_s: (performance.now() - t0) / 1e3, base_rss_bytes: base, node_llama_cpp: lib.version,
         node: process.version, build: llama.buildType, system_info: llama.systemInfo});

    const greedy = {temperature: 0};
    const full = {temperature: 1, topK: 0, topP: 1, minP: 0};  // the whole distribution, unchanged
    const rl = readline.createInterface({input: process.stdin, terminal: false});
    for await (const line of rl) {
        const req = JSON.parse(line);
        try {
            if (req.op === "generate") {
                await seq.clearHistory();
                seq.tokenPredictor?.updateInputTokens(req.prompt);  // what the chat classes do: the prompt to look in
                const before = {...seq.tokenPredictions};
                const start = performance.now();
                let first = null;
                const tokens = [];
                for await (const tok of seq.evaluate(req.prompt, greedy)) {
                    if (first === null) first = performance.now();
                    tokens.push(tok);
                    if (tokens.length >= req.n) break;
                }
                const end = performance.now();
                const rate = req.n > 1 && end > first ? (req.n - 1) / ((end - first) / 1e3) : null;
                const after = seq.tokenPredictions;
                const predictions = {validated: after.validated - before.validated, refuted: after.refuted - before.refuted};
                say({ttft_s: (first - start) / 1e3, decode_tok_s: rate, tokens, predictions});
            } else if (req.op === "logprobs") {
                await seq.clearHistory();
                const nVocab = req.n_vocab;
                const item = (t) => [t, {generateNext: {probabilities: true, options: full}}];
                const rows = [];
                if (req.steps) {
                    for (const t of req.prompt) rows.push((await seq.controlledEvaluate([item(t)]))[0]);
                } else {  // the prompt in one batch, the last position's distribution only
                    const items = [...req.prompt.slice(0, -1), item(req.prompt.at(-1))];
                    rows.push((await seq.controlledEvaluate(items)).at(-1));
                }
                const n = rows.length;
                const out = new Float32Array(n * nVocab).fill(-Infinity);
                rows.forEach((r, i) => {
                    for (const [tok, p] of r.next.probabilities) out[i * nVocab + tok] = Math.log(p);
                });
                fs.writeFileSync(req.out, Buffer.from(out.buffer));
                say({out: req.out, shape: [n, nVocab]});
            } else if (req.op === "memory") {
                say({peak_rss_bytes: rss("VmHWM"), rss_bytes: rss("VmRSS")});
            } else if (req.op === "quit") {
                say({bye: true});
                break;
            } else {
                say({error: `unknown op ${req.op}`});
            }
        } catch (err) {
            say({error: `${err.name}: ${err.message}`.slice(0, 500)});
        }
    }
    await context.dispose();
    await model.dispose();
    return 0;
}

process.exitCode = await main(process.argv.slice(2));
