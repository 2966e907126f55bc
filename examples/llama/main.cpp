// Copyright kvferry authors. Apache-2.0.
// kvferry-llama: a small Llama-family engine whose every attention call goes through kvferry.
//
//   kvferry-llama --model M.gguf --prompt "..." [--max-new 64] [--temperature 0.7 --top-p 0.9]
//   kvferry-llama --model M.gguf --perplexity --text data/kjv.txt --context 4096 --scored 1024
//   kvferry-llama --model M.gguf --passkey --text data/kjv.txt --lengths 2048,4096 --depths 0.1,0.5,0.9
//   kvferry-llama --model M.gguf --dump-trace t.safetensors --trace-layers 0,15,29 --trace-steps 32
//   kvferry-llama --model M.gguf --report --text data/kjv.txt  (the README's main job, summed up)
// Runtime: --policy streaming[,oracle] --budget 256[,512] --backend host|cuda|auto
//          --route auto|gpu|cpu --kv-dtype bf16|f16 --sinks 4 --window 64 --bank-slots 0
//          --param name=value  (evaluations add a dense lane next to every policy)
// Arguments are parsed and checked (examples/llama/cli.h) before the model is loaded; usage errors
// exit with 2, failed runs with 1.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/lib/safetensors.h"
#include "examples/llama/cli.h"
#include "examples/llama/engine.h"
#include "examples/llama/eval.h"
#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"
#include "kvferry/runtime.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

struct Lane {
  std::string label;
  std::string policy;
  int64_t budget = 0;
  std::unique_ptr<RuntimeAttention> attn;
};

Result<std::vector<Lane>> MakeLanes(const Options& o, const ModelConfig& mc, int64_t max_tokens,
                                    bool with_dense) {
  std::vector<Lane> lanes;
  const auto add = [&](const std::string& policy, int64_t budget) -> Status {
    RuntimeConfig rc = RuntimeConfigFor(mc, LaneConfig(o.base, policy));  // "name[:key=value...]"
    rc.policy.budget_tokens = budget;
    rc.capacity.max_sequences = 2;
    rc.capacity.max_batch = 1;
    rc.capacity.max_tokens_per_sequence = max_tokens;
    rc.capacity.max_prefill_chunk = o.chunk;
    auto attn = RuntimeAttention::Create(rc, mc);
    if (!attn.ok()) {
      return Status(attn.status().code(), StrCat("runtime for policy ", policy, " budget ", budget,
                                                 ": ", attn.status().message()));
    }
    Lane lane;
    lane.policy = policy;
    lane.budget = budget;
    lane.label = policy == "dense" ? "dense" : StrCat(policy, "@", budget);
    lane.attn = std::move(attn.value());
    lanes.push_back(std::move(lane));
    return Status::Ok();
  };
  if (with_dense) KVF_RETURN_IF_ERROR(add("dense", max_tokens));
  for (const std::string& p : o.policies) {
    if (p == "dense") {
      if (!with_dense) KVF_RETURN_IF_ERROR(add("dense", max_tokens));
      continue;
    }
    for (int64_t b : o.budgets) KVF_RETURN_IF_ERROR(add(p, b));
  }
  return lanes;
}

std::vector<Attention*> Attns(std::vector<Lane>& lanes) {
  std::vector<Attention*> out;
  for (Lane& l : lanes) out.push_back(l.attn.get());
  return out;
}

Result<std::string> ReadText(const std::string& path) {
  KVF_CHECK_ARG(!path.empty(), "--text FILE is required (run scripts/fetch-data.sh for data/kjv.txt)");
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path));
  return std::string(bytes.begin(), bytes.end());
}

// Tokens of the text from line offset_lines on, until \p count tokens (BOS first when the
// tokenizer wants one).
Result<std::vector<int32_t>> TextWindow(const Tokenizer& tok, const std::vector<std::string>& lines,
                                        int64_t offset_lines, int64_t count) {
  KVF_CHECK_ARG(count >= 1 && offset_lines >= 0, "text window of ", count, " tokens from line ",
                offset_lines);
  std::vector<int32_t> out;
  if (tok.add_bos()) out.push_back(tok.bos_id());
  for (int64_t i = offset_lines; static_cast<int64_t>(out.size()) < count; ++i) {
    KVF_CHECK_ARG(i < static_cast<int64_t>(lines.size()), "--text has ", lines.size(),
                  " non-empty lines: too short for ", count, " tokens from --offset-lines ",
                  offset_lines);
    for (int32_t id : tok.Encode(lines[i] + "\n", false)) out.push_back(id);
  }
  out.resize(count);
  return out;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

double MiB(double bytes) { return bytes / 1048576.0; }

// What one lane of a perplexity run measured; every figure the report prints comes from here.
struct LaneFigures {
  std::string label;
  PerplexityResult ppl;
  double decode_tok_s = 0;      // scored decode steps / their wall time
  DecodeTraffic traffic;        // PCIe bytes of the scored decode steps only
  int64_t gpu_kv_bytes = 0;     // KV kept on the GPU for the sequence (GpuKvBytes)
  int64_t host_reserved = 0;    // host-store bytes reserved after the window (Stats)
  int64_t device_reserved = 0;  // everything the runtime reserved on the device (Stats)
  Backend backend = Backend::kHost;
};

struct PerplexityRun {
  double prefill_seconds = 0;
  int64_t prefix_tokens = 0;  // tokens prefilled once into every lane
  std::vector<LaneFigures> lanes;
};

bool Emulated(Backend b) { return b == Backend::kHost; }

// Where ETF's frozen rows take their K and V from, for the report.
const char* EtfKvName(const EtfOptions& e) {
  return e.copy_kv ? "copied from the layer below" : "projected from the frozen hidden state";
}

Result<PerplexityRun> RunPerplexity(const Options& o, Engine& engine, const Tokenizer& tok,
                                    const ModelConfig& mc, std::ostream& json) {
  KVF_ASSIGN_OR_RETURN(std::string text, ReadText(o.text));
  const std::vector<std::string> lines = SplitLines(text);
  KVF_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, TextWindow(tok, lines, o.offset_lines, o.context));
  KVF_ASSIGN_OR_RETURN(std::vector<Lane> lanes, MakeLanes(o, mc, o.context, !o.no_dense));
  PerplexityRun run;
  run.prefix_tokens = o.context - o.scored - 1;
  std::vector<Stats> before(lanes.size()), after(lanes.size());
  const auto around_decode = [&](size_t lane, bool done) {
    (done ? after : before)[lane] = lanes[lane].attn->runtime().GetStats();
  };
  KVF_ASSIGN_OR_RETURN(auto results, EvalPerplexity(engine, tokens, o.scored, Attns(lanes), o.chunk,
                                                    &run.prefill_seconds, around_decode, o.lanes_together));
  const bool emulated = Emulated(lanes[0].attn->runtime().backend());
  std::printf("perplexity: %lld-token window of %s from line %lld, last %lld tokens scored; "
              "shared prefill of %lld tokens into %zu lanes %.1f s (%.0f tok/s)\n",
              static_cast<long long>(o.context), o.text.c_str(),
              static_cast<long long>(o.offset_lines), static_cast<long long>(o.scored),
              static_cast<long long>(run.prefix_tokens), lanes.size(), run.prefill_seconds,
              static_cast<double>(run.prefix_tokens) / run.prefill_seconds);
  std::printf("%-22s %10s %10s %12s %12s %18s %12s\n", "lane", "ppl", "nll/tok", "decode tok/s",
              "argmax=lane0", emulated ? "PCIe B/tok (emul.)" : "PCIe B/tok",
              emulated ? "GPU KV (emul.)" : "GPU KV");
  json << "{\"mode\": \"perplexity\", \"context\": " << o.context << ", \"scored\": " << o.scored
       << ", \"prefill_tokens\": " << run.prefix_tokens
       << ", \"prefill_seconds\": " << run.prefill_seconds
       << ", \"lanes_together\": " << (o.lanes_together ? "true" : "false")
       << ", \"decode_on_device\": " << (engine.gpu_decode() ? "true" : "false")
       << ", \"decode_graph_steps\": " << engine.decode_graph_steps();
  if (o.lanes_together) {
    std::printf("the lanes decoded each step together: decode tok/s is the step rate of all of them\n");
  }
  if (engine.etf().on) {
    const EtfOptions& e = engine.etf();
    json << ", \"etf\": {\"kv\": \"" << EtfKvName(e)
         << "\", \"psi\": " << e.psi << ", \"gamma\": " << e.gamma << ", \"start\": "
         << EtfStartLayer(e, mc.num_layers) << ", \"sink\": " << e.sink
         << ", \"frozen_row_fraction\": "
         << (engine.prefill_rows() > 0 ? static_cast<double>(engine.etf_frozen_rows()) /
                                             static_cast<double>(engine.prefill_rows())
                                       : 0.0)
         << "}";
  }
  json << ", \"emulated_gpu\": " << (emulated ? "true" : "false") << ", \"lanes\": [";
  for (size_t i = 0; i < lanes.size(); ++i) {
    LaneFigures f;
    f.label = lanes[i].label;
    f.ppl = results[i];
    f.decode_tok_s = static_cast<double>(f.ppl.scored) / f.ppl.decode_seconds;
    f.traffic = TrafficBetween(before[i], after[i], f.ppl.scored);
    f.gpu_kv_bytes = GpuKvBytes(mc, o.base.model.kv_dtype, o.base.tiers, o.context);
    f.host_reserved = after[i].host_bytes_reserved;
    f.device_reserved = after[i].device_bytes_reserved;
    f.backend = lanes[i].attn->runtime().backend();
    std::printf("%-22s %10.3f %10.4f %12.1f %11.1f%% %18.0f %8.2f MiB\n", f.label.c_str(),
                f.ppl.perplexity, f.ppl.nll_sum / static_cast<double>(f.ppl.scored), f.decode_tok_s,
                100.0 * static_cast<double>(f.ppl.argmax_agree) / static_cast<double>(f.ppl.scored),
                f.traffic.bytes_per_token(), MiB(static_cast<double>(f.gpu_kv_bytes)));
    json << (i ? ", " : "") << "{\"lane\": " << JsonString(f.label)
         << ", \"policy\": " << JsonString(lanes[i].policy) << ", \"budget\": " << lanes[i].budget
         << ", \"perplexity\": " << f.ppl.perplexity << ", \"scored\": " << f.ppl.scored
         << ", \"decode_seconds\": " << f.ppl.decode_seconds
         << ", \"decode_tokens_per_second\": " << f.decode_tok_s
         << ", \"argmax_agree\": " << f.ppl.argmax_agree
         << ", \"decode_pcie_bytes_h2d\": " << f.traffic.bytes_h2d
         << ", \"decode_pcie_bytes_d2h\": " << f.traffic.bytes_d2h
         << ", \"decode_pcie_bytes_per_token\": " << f.traffic.bytes_per_token()
         << ", \"gpu_kv_bytes_per_sequence\": " << f.gpu_kv_bytes
         << ", \"host_store_bytes_reserved\": " << f.host_reserved
         << ", \"device_bytes_reserved\": " << f.device_reserved
         << ", \"stats\": " << after[i].ToJson() << "}";
    run.lanes.push_back(std::move(f));
  }
  json << "]}";
  return run;
}

Status RunPasskey(const Options& o, Engine& engine, const Tokenizer& tok, const ModelConfig& mc,
                  std::ostream& json, int* found_dense, int* found_sparse, int* total) {
  KVF_ASSIGN_OR_RETURN(std::string text, ReadText(o.text));
  const std::vector<std::string> lines = SplitLines(text);
  int64_t max_len = 0;
  for (int64_t l : o.lengths) max_len = std::max(max_len, l);
  KVF_ASSIGN_OR_RETURN(std::vector<Lane> lanes, MakeLanes(o, mc, max_len + 64, !o.no_dense));
  std::vector<int> found(lanes.size(), 0);
  int trials = 0;
  std::mt19937_64 rng(o.seed);
  std::printf("passkey: %zu lanes;", lanes.size());
  for (const Lane& l : lanes) std::printf(" %s", l.label.c_str());
  std::printf("\n");
  json << "{\"mode\": \"passkey\", \"trials\": [";
  for (int64_t length : o.lengths) {
    for (double depth : o.depths) {
      for (int t = 0; t < o.trials; ++t) {
        const std::string key = std::to_string(10000 + rng() % 90000);
        const int64_t offset = o.offset_lines + static_cast<int64_t>(rng() % 20000);
        KVF_ASSIGN_OR_RETURN(PasskeyPrompt prompt,
                             BuildPasskeyPrompt(tok, lines, offset, length, depth, key, o.chat));
        auto t0 = std::chrono::steady_clock::now();
        KVF_ASSIGN_OR_RETURN(auto outs, GenerateGreedy(engine, prompt.tokens, 8, Attns(lanes),
                                                       o.chunk, tok.eos_id(), o.lanes_together));
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("  len %5lld depth %.2f key %s (%.1f s):", static_cast<long long>(length),
                    depth, key.c_str(), secs);
        json << (trials ? ", " : "") << "{\"length\": " << prompt.tokens.size()
             << ", \"depth\": " << depth << ", \"key\": \"" << key << "\", \"answers\": {";
        for (size_t i = 0; i < lanes.size(); ++i) {
          const std::string answer = tok.DecodeAll(outs[i]);
          const bool ok = FirstDigits(answer, 5) == key;
          found[i] += ok ? 1 : 0;
          std::printf(" %s=%s", lanes[i].label.c_str(), ok ? "found" : "MISS");
          json << (i ? ", " : "") << JsonString(lanes[i].label) << ": {\"found\": "
               << (ok ? "true" : "false") << ", \"answer\": " << JsonString(answer) << "}";
        }
        json << "}}";
        std::printf("\n");
        ++trials;
      }
    }
  }
  json << "], \"accuracy\": {";
  std::printf("passkey accuracy over %d prompts:\n", trials);
  for (size_t i = 0; i < lanes.size(); ++i) {
    std::printf("  %-22s %d/%d\n", lanes[i].label.c_str(), found[i], trials);
    json << (i ? ", " : "") << JsonString(lanes[i].label) << ": "
         << static_cast<double>(found[i]) / std::max(trials, 1);
  }
  json << "}}";
  if (found_dense != nullptr) *found_dense = found[0];
  if (found_sparse != nullptr) *found_sparse = found.size() > 1 ? found[1] : found[0];
  if (total != nullptr) *total = trials;
  return Status::Ok();
}

Status RunTrace(const Options& o, Engine& engine, const Tokenizer& tok, const Model& model,
                std::ostream& json) {
  const ModelConfig& mc = model.config;
  std::vector<int> layers = o.trace_layers;
  if (layers.empty()) {
    for (int l = 0; l < mc.num_layers; ++l) layers.push_back(l);
  }
  for (int l : layers) {
    KVF_CHECK_ARG(l >= 0 && l < mc.num_layers, "--trace-layers: layer ", l, " out of range [0, ",
                  mc.num_layers, ")");
  }
  std::vector<int32_t> tokens;
  if (!o.text.empty()) {
    KVF_ASSIGN_OR_RETURN(std::string text, ReadText(o.text));
    KVF_ASSIGN_OR_RETURN(tokens, TextWindow(tok, SplitLines(text), o.offset_lines, o.context));
  } else {
    KVF_CHECK_ARG(!o.prompt.empty(), "--dump-trace needs --text or --prompt");
    if (tok.add_bos()) tokens.push_back(tok.bos_id());
    for (int32_t id : tok.Encode(o.prompt, o.chat)) tokens.push_back(id);
  }
  // q/k/v of every traced layer, appended as the engine produces them.
  std::map<int, std::vector<float>> q, k, v;
  const int64_t qrow = static_cast<int64_t>(mc.num_q_heads) * mc.head_dim;
  const int64_t kvrow = static_cast<int64_t>(mc.num_kv_heads) * mc.head_dim;
  std::vector<bool> traced(mc.num_layers, false);
  for (int l : layers) traced[l] = true;
  engine.set_observer([&](int layer, int64_t, int64_t n, const float* qp, const float* kp,
                          const float* vp) {
    if (!traced[layer]) return;
    q[layer].insert(q[layer].end(), qp, qp + n * qrow);
    k[layer].insert(k[layer].end(), kp, kp + n * kvrow);
    v[layer].insert(v[layer].end(), vp, vp + n * kvrow);
  });
  Options dense_only = o;
  dense_only.policies = {"dense"};
  // Trace through the chosen policy's decode (it decides the generated tokens).
  KVF_ASSIGN_OR_RETURN(std::vector<Lane> lanes,
                       MakeLanes(o, mc, static_cast<int64_t>(tokens.size()) + o.trace_steps + 1,
                                 false));
  std::vector<Attention*> first{lanes[0].attn.get()};
  KVF_ASSIGN_OR_RETURN(auto gen, GenerateGreedy(engine, tokens, o.trace_steps, first, o.chunk, -1));
  engine.set_observer(nullptr);
  const int64_t total = static_cast<int64_t>(q[layers[0]].size()) / qrow;
  bench::SafetensorsFile file;
  std::string layer_list;
  for (int l : layers) {
    layer_list += StrCat(layer_list.empty() ? "" : ",", l);
    bench::AddFloatTensor(file, StrCat("layer.", l, ".q"), {total, mc.num_q_heads, mc.head_dim},
                          q[l].data(), o.trace_bf16);
    bench::AddFloatTensor(file, StrCat("layer.", l, ".k"), {total, mc.num_kv_heads, mc.head_dim},
                          k[l].data(), o.trace_bf16);
    bench::AddFloatTensor(file, StrCat("layer.", l, ".v"), {total, mc.num_kv_heads, mc.head_dim},
                          v[l].data(), o.trace_bf16);
  }
  std::vector<int32_t> all = tokens;
  all.insert(all.end(), gen[0].begin(), gen[0].end());
  all.resize(total);
  bench::SafetensorsTensor tok_tensor;
  tok_tensor.dtype = "I32";
  tok_tensor.shape = {total};
  tok_tensor.bytes.resize(total * 4);
  std::memcpy(tok_tensor.bytes.data(), all.data(), total * 4);
  file.tensors["tokens"] = std::move(tok_tensor);
  file.metadata = {
      {"format", "kvferry-trace-v1"},
      {"model", mc.name},
      {"model_file", o.model},
      {"num_layers", std::to_string(mc.num_layers)},
      {"layers", layer_list},
      {"num_q_heads", std::to_string(mc.num_q_heads)},
      {"num_kv_heads", std::to_string(mc.num_kv_heads)},
      {"head_dim", std::to_string(mc.head_dim)},
      {"rope_theta", StrCat(mc.rope_theta)},
      {"rope_layout", mc.rope_style == RopeStyle::kHalves ? "halves (Hugging Face rotate_half)"
                                                          : "adjacent pairs (llama2.c)"},
      {"positions", StrCat("0..", total - 1)},
      {"prefill_tokens", std::to_string(tokens.size() - 1)},
      {"decode_steps", std::to_string(total - static_cast<int64_t>(tokens.size()) + 1)},
      {"decode_policy", lanes[0].label},
      {"text", o.text.empty() ? "prompt" : StrCat(o.text, " from line ", o.offset_lines)},
      {"post_rope", "q and k are after RoPE; v as projected"},
  };
  KVF_RETURN_IF_ERROR(bench::WriteSafetensors(o.dump_trace, file));
  std::printf("trace: %lld positions (%zu prefill + %lld decode) of layers %s -> %s\n",
              static_cast<long long>(total), tokens.size() - 1,
              static_cast<long long>(total - static_cast<int64_t>(tokens.size()) + 1),
              layer_list.c_str(), o.dump_trace.c_str());
  json << "{\"mode\": \"trace\", \"file\": " << JsonString(o.dump_trace)
       << ", \"positions\": " << total << "}";
  return Status::Ok();
}

Status RunGenerate(const Options& o, Engine& engine, const Tokenizer& tok, const ModelConfig& mc) {
  KVF_CHECK_ARG(!o.prompt.empty(), "--prompt TEXT is required");
  std::vector<int32_t> tokens;
  if (tok.add_bos()) tokens.push_back(tok.bos_id());
  std::string text = o.prompt;
  if (o.chat && mc.arch == Arch::kGemma3) {  // Gemma's turns; off unless --chat
    text = "<start_of_turn>user\n" + o.prompt + "<end_of_turn>\n<start_of_turn>model\n";
  } else if (o.chat) {
    text = "<|im_start|>user\n" + o.prompt + "<|im_end|>\n<|im_start|>assistant\n";
  }
  for (int32_t id : tok.Encode(text, o.chat)) tokens.push_back(id);
  if (tokens.size() < 2) tokens.insert(tokens.begin(), tok.bos_id() >= 0 ? tok.bos_id() : 0);
  if (const std::string w = GenerationContextWarning(static_cast<int64_t>(tokens.size()), o.max_new,
                                                     mc.max_context);
      !w.empty()) {
    std::fprintf(stderr, "[kvferry-llama] %s\n", w.c_str());
  }
  Options one = o;
  one.policies = {o.policies[0]};
  one.budgets = {o.budgets[0]};
  KVF_ASSIGN_OR_RETURN(std::vector<Lane> lanes,
                       MakeLanes(one, mc, static_cast<int64_t>(tokens.size()) + o.max_new + 1, false));
  Attention& attn = *lanes[0].attn;
  std::vector<Attention*> attns{&attn};
  const int64_t prefix = static_cast<int64_t>(tokens.size()) - 1;
  auto t0 = std::chrono::steady_clock::now();
  KVF_RETURN_IF_ERROR(engine.Prefill(std::span<const int32_t>(tokens.data(), prefix), 0, attns,
                                     nullptr, false, o.chunk));
  std::mt19937_64 rng(o.seed);
  std::vector<float> logits;
  int32_t token = tokens.back();
  std::fputs(o.prompt.c_str(), stdout);
  int produced = 0;
  auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.max_new; ++i) {
    KVF_RETURN_IF_ERROR(engine.Decode(token, prefix + i, attn, &logits));
    token = SampleToken(logits, o.temperature, o.top_p, rng);
    if (token == tok.eos_id()) break;
    std::fputs(tok.Decode(token).c_str(), stdout);
    std::fflush(stdout);
    ++produced;
  }
  const auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  const auto t2 = std::chrono::steady_clock::now();
  std::printf("\n[%s: prompt %lld tokens in %.2f s, %d new tokens at %.1f tok/s]\n",
              lanes[0].label.c_str(), static_cast<long long>(prefix), secs(t0, t1), produced,
              produced / std::max(secs(t1, t2), 1e-9));
  return Status::Ok();
}

Status RunReport(Options o, Engine& engine, const Tokenizer& tok, const Model& model,
                 std::ostream& json) {
  const ModelConfig& mc = model.config;
  // One sparse lane (the first policy and budget) next to dense.
  o.policies = {o.policies[0]};
  o.budgets = {o.budgets[0]};
  o.no_dense = o.policies[0] == "dense";
  json << "{\"mode\": \"report\", \"perplexity\": ";
  std::ostringstream ppl_json;
  auto t0 = std::chrono::steady_clock::now();
  KVF_ASSIGN_OR_RETURN(PerplexityRun ppl, RunPerplexity(o, engine, tok, mc, ppl_json));
  json << ppl_json.str() << ", \"passkey\": ";
  int found_dense = 0, found_sparse = 0, total = 0;
  Options pk = o;
  pk.lengths = {o.context};
  pk.depths = {0.5};
  KVF_RETURN_IF_ERROR(RunPasskey(pk, engine, tok, mc, json, &found_dense, &found_sparse, &total));
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const LaneFigures& dense = ppl.lanes.front();
  const LaneFigures& sparse = ppl.lanes.back();
  const bool emulated = Emulated(sparse.backend);
  const int64_t dense_cache = o.context * KvBytesPerToken(mc, o.base.model.kv_dtype);
  const Tiers& tiers = o.base.tiers;
  std::printf("\n==== kvferry main job: %s, %lld-token window of %s from line %lld, %s vs dense "
              "====\n",
              FileLabel(o.model).c_str(), static_cast<long long>(o.context),
              std::filesystem::path(o.text).filename().string().c_str(),
              static_cast<long long>(o.offset_lines), sparse.label.c_str());
  if (emulated) {
    std::printf("backend host: no GPU here; the GPU and PCIe below are emulated in host memory "
                "(bytes are what the CUDA backend would move)\n");
  } else {
    std::printf("backend %s\n", BackendName(sparse.backend));
  }
  const int64_t per_token = KvBytesPerToken(mc, o.base.model.kv_dtype);
  std::printf("perplexity          dense %.3f, %s %.3f   (last %lld tokens scored by decode)\n",
              dense.ppl.perplexity, sparse.label.c_str(), sparse.ppl.perplexity,
              static_cast<long long>(o.scored));
  std::printf("prefill             %10.1f tok/s   (%lld-token prefix, one model pass into %zu "
              "lanes)\n",
              static_cast<double>(ppl.prefix_tokens) / ppl.prefill_seconds,
              static_cast<long long>(ppl.prefix_tokens), ppl.lanes.size());
  std::printf("decode              %10.1f tok/s   (%s over the %lld scored steps; dense %.1f)\n",
              sparse.decode_tok_s, sparse.label.c_str(), static_cast<long long>(sparse.ppl.scored),
              dense.decode_tok_s);
  if (engine.gpu_decode()) {
    std::printf("decode path         every activation on the GPU (cuBLAS products, f32); %lld steps "
                "replayed from CUDA graphs\n", static_cast<long long>(engine.decode_graph_steps()));
  }
  std::printf("KV kept on the GPU  %10.2f MiB     per sequence%s: min(%lld tokens, sinks %d + "
              "window %d + bank %d) = %lld rows x %lld B per token\n",
              MiB(static_cast<double>(sparse.gpu_kv_bytes)), emulated ? " (emulated)" : "",
              static_cast<long long>(o.context), tiers.sink_tokens, tiers.window_tokens,
              tiers.bank_slots, static_cast<long long>(GpuKvRows(tiers, o.context)),
              static_cast<long long>(per_token));
  std::printf("  vs a GPU-only dense cache %.2f MiB: %lld tokens x %lld B = %.1f%% of it on the GPU\n",
              MiB(static_cast<double>(dense_cache)), static_cast<long long>(o.context),
              static_cast<long long>(per_token),
              100.0 * static_cast<double>(sparse.gpu_kv_bytes) / static_cast<double>(dense_cache));
  std::printf("KV in host memory   %10.2f MiB     (all %lld tokens; the host store has %.2f MiB "
              "reserved)\n",
              MiB(static_cast<double>(dense_cache)), static_cast<long long>(o.context),
              MiB(static_cast<double>(sparse.host_reserved)));
  std::printf("%-20s%10.0f bytes   per decoded token, %s (h2d %lld + d2h %lld over %lld decode "
              "steps; dense %.0f)\n",
              emulated ? "PCIe (emulated)" : "PCIe", sparse.traffic.bytes_per_token(),
              sparse.label.c_str(), static_cast<long long>(sparse.traffic.bytes_h2d),
              static_cast<long long>(sparse.traffic.bytes_d2h),
              static_cast<long long>(sparse.traffic.tokens), dense.traffic.bytes_per_token());
  std::printf("passkey             dense %d/%d, %s %d/%d   (key at depth 0.5 of a %lld-token "
              "prompt)\n",
              found_dense, total, sparse.label.c_str(), found_sparse, total,
              static_cast<long long>(o.context));
  std::printf("device reserved     %10.2f MiB     (%s memory the runtime allocated: sinks and "
              "window of 2 sequence slots, staging, plan buffers)\n",
              MiB(static_cast<double>(sparse.device_reserved)), emulated ? "emulated GPU" : "GPU");
  std::printf("total time          %10.1f s\n", total_s);
  json << ", \"summary\": {\"model\": " << JsonString(FileLabel(o.model))
       << ", \"text\": " << JsonString(o.text) << ", \"lane\": " << JsonString(sparse.label)
       << ", \"backend\": " << JsonString(BackendName(sparse.backend))
       << ", \"emulated_gpu\": " << (emulated ? "true" : "false")
       << ", \"decode_on_device\": " << (engine.gpu_decode() ? "true" : "false")
       << ", \"decode_graph_steps\": " << engine.decode_graph_steps()
       << ", \"perplexity_dense\": " << dense.ppl.perplexity
       << ", \"perplexity_sparse\": " << sparse.ppl.perplexity
       << ", \"prefill_tokens_per_second\": "
       << static_cast<double>(ppl.prefix_tokens) / ppl.prefill_seconds
       << ", \"decode_tokens_per_second\": " << sparse.decode_tok_s
       << ", \"gpu_kv_bytes_per_sequence\": " << sparse.gpu_kv_bytes
       << ", \"dense_gpu_cache_bytes\": " << dense_cache
       << ", \"host_kv_bytes\": " << dense_cache
       << ", \"host_store_bytes_reserved\": " << sparse.host_reserved
       << ", \"decode_pcie_bytes_per_token\": " << sparse.traffic.bytes_per_token()
       << ", \"passkey_dense\": " << found_dense << ", \"passkey_sparse\": " << found_sparse
       << ", \"passkey_trials\": " << total << ", \"device_bytes_reserved\": "
       << sparse.device_reserved << ", \"seconds\": " << total_s << "}}";
  return Status::Ok();
}

Status Run(const Options& o) {
  auto t0 = std::chrono::steady_clock::now();
  KVF_ASSIGN_OR_RETURN(Model model, LoadModel(o.model));
  std::unique_ptr<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    KVF_ASSIGN_OR_RETURN(tok, LoadLlama2cTokenizer(o.tokenizer, model.config.vocab_size));
  } else {
    KVF_ASSIGN_OR_RETURN(tok, LoadGgufTokenizer(o.model));
  }
  const ModelConfig& mc = model.config;
  std::fprintf(stderr, "[kvferry-llama] %s (%s): %d layers, %d/%d heads, head_dim %d, vocab %d, "
               "loaded in %.1f s\n", FileLabel(o.model).c_str(), mc.name.c_str(), mc.num_layers,
               mc.num_q_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!mc.layer_window.empty()) {
    int global = 0;
    for (int w : mc.layer_window) global += w == 0;
    std::fprintf(stderr, "[kvferry-llama] %d global layers (the policy) and %d sliding-window "
                 "layers (their window only, on the device: the Runtime's layer_window)\n", global,
                 mc.num_layers - global);
  }
  if (const std::string w = TrainedContextWarning(o, mc.max_context); !w.empty()) {
    std::fprintf(stderr, "[kvferry-llama] %s\n", w.c_str());
  }
  Engine engine(model);
  // Matrix products follow the attention backend: cuBLAS when kvferry runs on CUDA.
  const bool want_gpu = o.base.backend == Backend::kCuda ||
                        (o.base.backend == Backend::kAuto && CudaAvailable());
  if (want_gpu) {
    const Status s = engine.UseGpuMatmul(o.base.device_id);
    if (!s.ok() && o.base.backend == Backend::kCuda) return s;
  }
  if (engine.gpu_matmul() && !o.host_decode) {
    KVF_RETURN_IF_ERROR(engine.UseGpuDecode());
    engine.SetDecodeGraphs(!o.no_graphs);
  }
  std::fprintf(stderr, "[kvferry-llama] matrix products on %s%s\n",
               engine.gpu_matmul() ? "the GPU (cuBLAS)" : "the CPU (oneDNN)",
               engine.gpu_decode() ? "; decode steps with their activations on the GPU" : "");
  if (o.etf.on) {
    EtfOptions etf = o.etf;
    etf.sink = o.base.tiers.sink_tokens;
    KVF_RETURN_IF_ERROR(engine.set_etf(etf));
    const int start = EtfStartLayer(etf, mc.num_layers);
    std::fprintf(stderr, "[kvferry-llama] ETF at prefill: psi %g, gamma %g, from layer %d, sinks %d, K/V %s\n",
                 etf.psi, etf.gamma, start, etf.sink,
                 EtfKvName(etf));
  }
  std::ostringstream json;
  switch (o.mode) {
    case Mode::kGenerate: return RunGenerate(o, engine, *tok, mc);
    case Mode::kPerplexity: {
      KVF_ASSIGN_OR_RETURN(PerplexityRun run, RunPerplexity(o, engine, *tok, mc, json));
      (void)run;
      break;
    }
    case Mode::kPasskey:
      KVF_RETURN_IF_ERROR(RunPasskey(o, engine, *tok, mc, json, nullptr, nullptr, nullptr));
      break;
    case Mode::kTrace: KVF_RETURN_IF_ERROR(RunTrace(o, engine, *tok, model, json)); break;
    case Mode::kReport: KVF_RETURN_IF_ERROR(RunReport(o, engine, *tok, model, json)); break;
  }
  if (!o.json_out.empty()) {
    std::ofstream out(o.json_out);
    out << json.str() << "\n";
    if (!out) return IoError(StrCat("cannot write ", o.json_out));
  }
  return Status::Ok();
}

int Main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines show up when piped to a log
  Result<Options> o = ParseArgs(argc, argv);
  if (o.ok() && o->help) {
    std::fputs(UsageText().c_str(), stdout);
    return kExitOk;
  }
  const Status usage = o.ok() ? CheckBeforeLoad(*o) : o.status();
  if (!usage.ok()) {
    std::fprintf(stderr, "kvferry-llama: %s\n(kvferry-llama --help lists the options)\n",
                 usage.message().c_str());
    return kExitUsage;
  }
  const Status st = Run(*o);
  if (!st.ok()) {
    std::fprintf(stderr, "kvferry-llama: %s\n", st.ToString().c_str());
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace
}  // namespace kvferry::llama

int main(int argc, char** argv) {
  // Errors are values inside; this only turns an escaped exception (e.g. std::bad_alloc on a
  // machine without memory for the model) into a message instead of an abort.
  try {
    return kvferry::llama::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvferry-llama: unexpected error: %s\n", e.what());
    return kvferry::llama::kExitFailure;
  }
}
