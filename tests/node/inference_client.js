#!/usr/bin/env node
// A Node.js client of Tandem's public gRPC API (tandem.v1.Inference), loaded from the .proto files
// at run time with @grpc/proto-loader: proof that a non-Python client needs nothing but the
// contracts in protos/.
//
// Usage: node inference_client.js <host:port> <protos_root_dir> <model> <prompt> <max_tokens>
//
// Output, one JSON object per line on stdout:
//   {"models": [...]}                      the ListModels answer
//   {"request_id": ..., "text": ..., ...}  each Generate chunk, as decoded (keepCase field names)
//   {"done": true, "text": ..., "num_tokens": ..., "finish_reason": ..., "usage": ...}
// On any RPC error: {"error": {"code": <grpc status number>, "details": ...}} and exit status 1.
// Environment: TANDEM_CLIENT_DEADLINE_S (default 60) bounds each call.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const USAGE = 'usage: node inference_client.js <host:port> <protos_root_dir> <model> <prompt> <max_tokens>';

function emit(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n');
}

function fail(err) {
  emit({ error: { code: err.code, details: err.details || err.message } });
  process.exitCode = 1;
}

function parseArgs(argv) {
  if (argv.length !== 5) {
    process.stderr.write(USAGE + '\n');
    process.exit(2);
  }
  const [address, protosRoot, model, prompt, maxTokensText] = argv;
  const maxTokens = Number.parseInt(maxTokensText, 10);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) {
    process.stderr.write(`max_tokens must be a positive integer, got ${maxTokensText}\n` + USAGE + '\n');
    process.exit(2);
  }
  return { address, protosRoot: path.resolve(protosRoot), model, prompt, maxTokens };
}

function loadInferenceService(protosRoot) {
  const definition = protoLoader.loadSync('tandem/v1/inference.proto', {
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [protosRoot],
  });
  return grpc.loadPackageDefinition(definition).tandem.v1.Inference;
}

function deadline() {
  const seconds = Number(process.env.TANDEM_CLIENT_DEADLINE_S || 60);
  return new Date(Date.now() + seconds * 1000);
}

function listModels(client) {
  return new Promise((resolve, reject) => {
    client.ListModels({}, { deadline: deadline() }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// Streams Generate, printing every chunk; resolves with the summary line.
function generate(client, { model, prompt, maxTokens }) {
  const request = {
    model,
    chat: { messages: [{ role: 'user', content: prompt }] },
    sampling: { max_tokens: maxTokens, temperature: 0 },
  };
  return new Promise((resolve, reject) => {
    const summary = { done: true, text: '', num_tokens: 0, finish_reason: null, usage: null };
    const call = client.Generate(request, { deadline: deadline() });
    call.on('data', (chunk) => {
      emit(chunk);
      summary.text += chunk.text;
      summary.num_tokens += chunk.token_ids.length;
      if (chunk.finish_reason && chunk.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
        summary.finish_reason = chunk.finish_reason;
      }
      if (chunk.usage) {
        summary.usage = chunk.usage;
      }
    });
    // grpc-js emits 'error' for a non-OK status and 'end' + 'status' for OK.
    call.on('error', reject);
    call.on('status', (status) => {
      if (status.code === grpc.status.OK) {
        resolve(summary);
      }
    });
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const Inference = loadInferenceService(args.protosRoot);
  const client = new Inference(args.address, grpc.credentials.createInsecure());
  try {
    const models = await listModels(client);
    emit({ models: models.models });
    emit(await generate(client, args));
  } catch (err) {
    fail(err);
  } finally {
    client.close();
  }
}

main();
