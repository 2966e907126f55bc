// Copyright kvferry authors. Apache-2.0.
// kvferry-llama: a small Llama-family engine whose every attention call goes through kvferry.
//
//   kvferry-llama --model M.gguf --prompt "..." [--max-new 64] [--temperature 0.7 --top-p 0.9]
//   kvferry-llama --model M.gguf --perplexity --text data/kjv.txt --context 4096 --scored 1024
//   kvferry-llama --model M.gguf --passkey --text data/kjv.txt --lengths 2048,4096 --depths 0.1,0.5,0.9
//   kvferry-llama --model M.gguf --dump-trace t.safetensors --trace-layers 0,15,29 --trace-steps 32
//   kvferry-llama --model M.gguf --report        (the README's main job: all of the above, summed up)
// Runtime: --policy streaming[,oracle] --budget 256[,512] --backend host|cuda|auto
//          --route auto|gpu|cpu --kv-dtype bf16|f16 --sinks 4 --window 64 --bank-slots 0
//          --param name=value  (evaluations add a dense lane next to every policy)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/lib/safetensors.h"
#include "examples/llama/engine.h"
#include "examples/llama/eval.h"
#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"
#include "gpu/device.h"
#include "runtime/check.h"

namespace kvferry::llama {
namespace {

using detail::StrCat;

struct Options {
  std::string model, tokenizer, text, prompt, json_out, dump_trace;
  std::string mode = "generate";
  int max_new = 64;
  float temperature = 0.0f, top_p = 0.9f;
  uint64_t seed = 1;
  bool chat = false;
  int64_t context = 2048, scored = 512, offset_lines = 0, chunk = 512;
  std::vector<int64_t> lengths{2048};
  std::vector<double> depths{0.1, 0.5, 0.9};
  int trials = 1;
  std::vector<int> trace_layers{0};
  int trace_steps = 16;
  bool trace_bf16 = false;
  std::vector<std::string> policies{"streaming"};
  std::vector<int64_t> budgets{256};
  RuntimeConfig base;
  bool no_dense = false;
};

template <typename T>
Result<std::vector<T>> ParseList(const std::string& s) {
  std::vector<T> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::stringstream is(item);
    T v{};
    if (!(is >> v)) return InvalidArgument(StrCat("bad list item '", item, "' in '", s, "'"));
    out.push_back(v);
  }
  if (out.empty()) return InvalidArgument(StrCat("empty list '", s, "'"));
  return out;
}

void Usage() {
  std::fprintf(stderr,
               "usage: kvferry-llama --model FILE [--tokenizer tok.bin] MODE [options]\n"
               "modes: --prompt TEXT | --perplexity | --passkey | --dump-trace FILE | --report\n"
               "text:  --text FILE --offset-lines N --context N --scored N --chunk N\n"
               "gen:   --max-new N --temperature T --top-p P --seed S --chat\n"
               "passkey: --lengths 2048,4096 --depths 0.1,0.5,0.9 --trials N\n"
               "trace: --trace-layers 0,15 | all --trace-steps N --trace-dtype f32|bf16\n"
               "runtime: --policy a[,b] --budget n[,m] --backend host|cuda|auto --route "
               "auto|gpu|cpu\n         --kv-dtype bf16|f16 --sinks N --window N --bank-slots N "
               "--param k=v --no-dense\n"
               "output: --json FILE\n");
}

Result<Options> ParseArgs(int argc, char** argv) {
  Options o;
  o.base.tiers.sink_tokens = 4;
  o.base.tiers.window_tokens = 64;
  o.base.model.kv_dtype = DType::kF16;
  std::string layers_arg;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> Result<std::string> {
      if (i + 1 >= argc) return InvalidArgument(StrCat(a, " needs a value"));
      return std::string(argv[++i]);
    };
    const auto num = [&]() -> Result<double> {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0') return InvalidArgument(StrCat(a, ": bad number ", v));
      return d;
    };
    if (a == "--model") { KVF_ASSIGN_OR_RETURN(o.model, next()); }
    else if (a == "--tokenizer") { KVF_ASSIGN_OR_RETURN(o.tokenizer, next()); }
    else if (a == "--text") { KVF_ASSIGN_OR_RETURN(o.text, next()); }
    else if (a == "--prompt") { KVF_ASSIGN_OR_RETURN(o.prompt, next()); o.mode = "generate"; }
    else if (a == "--perplexity") { o.mode = "perplexity"; }
    else if (a == "--passkey") { o.mode = "passkey"; }
    else if (a == "--report") { o.mode = "report"; }
    else if (a == "--dump-trace") { KVF_ASSIGN_OR_RETURN(o.dump_trace, next()); o.mode = "trace"; }
    else if (a == "--json") { KVF_ASSIGN_OR_RETURN(o.json_out, next()); }
    else if (a == "--max-new") { KVF_ASSIGN_OR_RETURN(double v, num()); o.max_new = static_cast<int>(v); }
    else if (a == "--temperature") { KVF_ASSIGN_OR_RETURN(double v, num()); o.temperature = static_cast<float>(v); }
    else if (a == "--top-p") { KVF_ASSIGN_OR_RETURN(double v, num()); o.top_p = static_cast<float>(v); }
    else if (a == "--seed") { KVF_ASSIGN_OR_RETURN(double v, num()); o.seed = static_cast<uint64_t>(v); }
    else if (a == "--chat") { o.chat = true; }
    else if (a == "--context") { KVF_ASSIGN_OR_RETURN(double v, num()); o.context = static_cast<int64_t>(v); }
    else if (a == "--scored") { KVF_ASSIGN_OR_RETURN(double v, num()); o.scored = static_cast<int64_t>(v); }
    else if (a == "--offset-lines") { KVF_ASSIGN_OR_RETURN(double v, num()); o.offset_lines = static_cast<int64_t>(v); }
    else if (a == "--chunk") { KVF_ASSIGN_OR_RETURN(double v, num()); o.chunk = static_cast<int64_t>(v); }
    else if (a == "--trials") { KVF_ASSIGN_OR_RETURN(double v, num()); o.trials = static_cast<int>(v); }
    else if (a == "--lengths") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      KVF_ASSIGN_OR_RETURN(o.lengths, ParseList<int64_t>(v));
    } else if (a == "--depths") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      KVF_ASSIGN_OR_RETURN(o.depths, ParseList<double>(v));
    }
    else if (a == "--trace-layers") { KVF_ASSIGN_OR_RETURN(layers_arg, next()); }
    else if (a == "--trace-steps") { KVF_ASSIGN_OR_RETURN(double v, num()); o.trace_steps = static_cast<int>(v); }
    else if (a == "--trace-dtype") { KVF_ASSIGN_OR_RETURN(std::string v, next()); KVF_CHECK_ARG(v == "f32" || v == "bf16", "--trace-dtype f32|bf16"); o.trace_bf16 = v == "bf16"; }
    else if (a == "--policy") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      KVF_ASSIGN_OR_RETURN(o.policies, ParseList<std::string>(v));
    } else if (a == "--budget") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      KVF_ASSIGN_OR_RETURN(o.budgets, ParseList<int64_t>(v));
    } else if (a == "--backend") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v == "host") o.base.backend = Backend::kHost;
      else if (v == "cuda") o.base.backend = Backend::kCuda;
      else if (v == "auto") o.base.backend = Backend::kAuto;
      else return InvalidArgument(StrCat("--backend ", v, ": host|cuda|auto"));
    } else if (a == "--route") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v == "auto") o.base.route = Route::kAuto;
      else if (v == "gpu") o.base.route = Route::kGpu;
      else if (v == "cpu") o.base.route = Route::kCpu;
      else return InvalidArgument(StrCat("--route ", v, ": auto|gpu|cpu"));
    } else if (a == "--kv-dtype") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      if (v == "bf16") o.base.model.kv_dtype = DType::kBF16;
      else if (v == "f16") o.base.model.kv_dtype = DType::kF16;
      else return InvalidArgument(StrCat("--kv-dtype ", v, ": bf16|f16"));
    } else if (a == "--sinks") { KVF_ASSIGN_OR_RETURN(double v, num()); o.base.tiers.sink_tokens = static_cast<int>(v); }
    else if (a == "--window") { KVF_ASSIGN_OR_RETURN(double v, num()); o.base.tiers.window_tokens = static_cast<int>(v); }
    else if (a == "--bank-slots") { KVF_ASSIGN_OR_RETURN(double v, num()); o.base.tiers.bank_slots = static_cast<int>(v); }
    else if (a == "--cpu-threads") { KVF_ASSIGN_OR_RETURN(double v, num()); o.base.cpu_threads = static_cast<int>(v); }
    else if (a == "--param") {
      KVF_ASSIGN_OR_RETURN(std::string v, next());
      const size_t eq = v.find('=');
      KVF_CHECK_ARG(eq != std::string::npos, "--param wants name=value, got ", v);
      o.base.policy.params[v.substr(0, eq)] = std::strtod(v.c_str() + eq + 1, nullptr);
    } else if (a == "--no-dense") { o.no_dense = true; }
    else if (a == "-h" || a == "--help") { Usage(); std::exit(0); }
    else return InvalidArgument(StrCat("unknown option ", a));
  }
  KVF_CHECK_ARG(!o.model.empty(), "--model is required");
  if (!layers_arg.empty() && layers_arg != "all") {
    KVF_ASSIGN_OR_RETURN(o.trace_layers, ParseList<int>(layers_arg));
  } else if (layers_arg == "all") {
    o.trace_layers.clear();  // filled once the model is known
  }
  return o;
}

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
    RuntimeConfig rc = RuntimeConfigFor(mc, o.base);
    rc.policy.name = policy;
    rc.policy.budget_tokens = budget;
    rc.capacity.max_sequences = 2;
    rc.capacity.max_batch = 1;
    rc.capacity.max_tokens_per_sequence = max_tokens;
    rc.capacity.max_prefill_chunk = o.chunk;
    auto attn = RuntimeAttention::Create(rc);
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
  std::vector<int32_t> out;
  if (tok.add_bos()) out.push_back(tok.bos_id());
  for (int64_t i = offset_lines; static_cast<int64_t>(out.size()) < count; ++i) {
    KVF_CHECK_ARG(i < static_cast<int64_t>(lines.size()), "text too short for ", count, " tokens");
    for (int32_t id : tok.Encode(lines[i] + "\n", false)) out.push_back(id);
  }
  out.resize(count);
  return out;
}

double KvBytesDense(const ModelConfig& mc, int64_t tokens, DType dtype) {
  return 2.0 * static_cast<double>(tokens) * mc.num_layers * mc.num_kv_heads * mc.head_dim *
         static_cast<double>(DTypeSize(dtype));
}

struct Json {
  std::ostringstream os;
  bool first = true;
  void Key(const std::string& k) {
    os << (first ? "" : ", ") << "\"" << k << "\": ";
    first = false;
  }
};

Status RunPerplexity(const Options& o, Engine& engine, const Tokenizer& tok, const ModelConfig& mc,
                     std::ostream& json) {
  KVF_ASSIGN_OR_RETURN(std::string text, ReadText(o.text));
  const std::vector<std::string> lines = SplitLines(text);
  KVF_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, TextWindow(tok, lines, o.offset_lines, o.context));
  KVF_ASSIGN_OR_RETURN(std::vector<Lane> lanes, MakeLanes(o, mc, o.context, !o.no_dense));
  double prefill_s = 0;
  KVF_ASSIGN_OR_RETURN(auto results, EvalPerplexity(engine, tokens, o.scored, Attns(lanes),
                                                    o.chunk, &prefill_s));
  std::printf("perplexity: %lld-token window of %s from line %lld, last %lld tokens scored; "
              "shared prefill %.1f s (%.0f tok/s)\n",
              static_cast<long long>(o.context), o.text.c_str(),
              static_cast<long long>(o.offset_lines), static_cast<long long>(o.scored), prefill_s,
              static_cast<double>(o.context - o.scored - 1) / prefill_s);
  std::printf("%-22s %10s %10s %12s %12s %14s\n", "lane", "ppl", "nll/tok", "decode tok/s",
              "argmax=lane0", "PCIe B/token");
  json << "{\"mode\": \"perplexity\", \"context\": " << o.context << ", \"scored\": " << o.scored
       << ", \"prefill_seconds\": " << prefill_s << ", \"lanes\": [";
  for (size_t i = 0; i < lanes.size(); ++i) {
    const PerplexityResult& r = results[i];
    const Stats st = lanes[i].attn->runtime().GetStats();
    const double per_token =
        static_cast<double>(st.bytes_h2d + st.bytes_d2h) / static_cast<double>(r.scored);
    std::printf("%-22s %10.3f %10.4f %12.1f %11.1f%% %14.0f\n", lanes[i].label.c_str(),
                r.perplexity, r.nll_sum / static_cast<double>(r.scored),
                static_cast<double>(r.scored) / r.decode_seconds,
                100.0 * static_cast<double>(r.argmax_agree) / static_cast<double>(r.scored),
                per_token);
    json << (i ? ", " : "") << "{\"lane\": \"" << lanes[i].label << "\", \"policy\": \""
         << lanes[i].policy << "\", \"budget\": " << lanes[i].budget
         << ", \"perplexity\": " << r.perplexity << ", \"scored\": " << r.scored
         << ", \"decode_seconds\": " << r.decode_seconds << ", \"argmax_agree\": "
         << r.argmax_agree << ", \"pcie_bytes_per_token\": " << per_token
         << ", \"stats\": " << st.ToJson() << "}";
  }
  json << "]}";
  return Status::Ok();
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
                                                       o.chunk, tok.eos_id()));
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
          std::string escaped;
          for (char c : answer) {
            if (c == '"' || c == '\\') escaped += '\\';
            if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
          }
          json << (i ? ", " : "") << "\"" << lanes[i].label << "\": {\"found\": "
               << (ok ? "true" : "false") << ", \"answer\": \"" << escaped << "\"}";
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
    json << (i ? ", " : "") << "\"" << lanes[i].label << "\": "
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
  json << "{\"mode\": \"trace\", \"file\": \"" << o.dump_trace << "\", \"positions\": " << total
       << "}";
  return Status::Ok();
}

Status RunGenerate(const Options& o, Engine& engine, const Tokenizer& tok, const ModelConfig& mc) {
  KVF_CHECK_ARG(!o.prompt.empty(), "--prompt TEXT is required");
  std::vector<int32_t> tokens;
  if (tok.add_bos()) tokens.push_back(tok.bos_id());
  std::string text = o.prompt;
  if (o.chat) text = "<|im_start|>user\n" + o.prompt + "<|im_end|>\n<|im_start|>assistant\n";
  for (int32_t id : tok.Encode(text, o.chat)) tokens.push_back(id);
  if (tokens.size() < 2) tokens.insert(tokens.begin(), tok.bos_id() >= 0 ? tok.bos_id() : 0);
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

Status RunReport(Options o, Engine& engine, const Tokenizer& tok, const ModelConfig& mc,
                 std::ostream& json) {
  // One sparse lane (the first policy and budget) next to dense.
  o.policies = {o.policies[0]};
  o.budgets = {o.budgets[0]};
  json << "{\"mode\": \"report\", \"perplexity\": ";
  std::ostringstream ppl_json;
  auto t0 = std::chrono::steady_clock::now();
  KVF_RETURN_IF_ERROR(RunPerplexity(o, engine, tok, mc, ppl_json));
  json << ppl_json.str() << ", \"passkey\": ";
  int found_dense = 0, found_sparse = 0, total = 0;
  Options pk = o;
  pk.lengths = {o.context};
  pk.depths = {0.5};
  KVF_RETURN_IF_ERROR(RunPasskey(pk, engine, tok, mc, json, &found_dense, &found_sparse, &total));
  json << "}";
  // Memory and traffic of the sparse lane on its own decode run.
  KVF_ASSIGN_OR_RETURN(std::string text, ReadText(o.text));
  KVF_ASSIGN_OR_RETURN(std::vector<int32_t> tokens,
                       TextWindow(tok, SplitLines(text), o.offset_lines, o.context));
  KVF_ASSIGN_OR_RETURN(std::vector<Lane> lanes, MakeLanes(o, mc, o.context, false));
  std::vector<Attention*> attns{lanes[0].attn.get()};
  const int64_t steps = std::min<int64_t>(64, o.scored);
  const int64_t prefix = o.context - steps;
  auto p0 = std::chrono::steady_clock::now();
  KVF_RETURN_IF_ERROR(engine.Prefill(std::span<const int32_t>(tokens.data(), prefix), 0, attns,
                                     nullptr, false, o.chunk));
  auto p1 = std::chrono::steady_clock::now();
  Runtime& rt = lanes[0].attn->runtime();
  rt.ResetStats();
  std::vector<float> logits;
  for (int64_t p = prefix; p < o.context; ++p) {
    KVF_RETURN_IF_ERROR(engine.Decode(tokens[p], p, *lanes[0].attn, &logits));
  }
  auto p2 = std::chrono::steady_clock::now();
  const Stats st = rt.GetStats();
  const double prefill_tps = static_cast<double>(prefix) / std::chrono::duration<double>(p1 - p0).count();
  const double decode_tps = static_cast<double>(steps) / std::chrono::duration<double>(p2 - p1).count();
  const double dense_bytes = KvBytesDense(mc, o.context, o.base.model.kv_dtype);
  std::printf("\n==== kvferry main job: %s on %lld tokens of KJV, %s (backend %s) ====\n",
              mc.name.c_str(), static_cast<long long>(o.context), lanes[0].label.c_str(),
              BackendName(rt.backend()));
  std::printf("prefill            %10.1f tok/s\n", prefill_tps);
  std::printf("decode             %10.1f tok/s   (%lld steps at context %lld)\n", decode_tps,
              static_cast<long long>(steps), static_cast<long long>(o.context));
  std::printf("KV on GPU          %10.2f MiB     (dense would hold %.2f MiB: %.1f%%)\n",
              static_cast<double>(st.device_bytes_reserved) / 1048576.0, dense_bytes / 1048576.0,
              100.0 * static_cast<double>(st.device_bytes_reserved) / dense_bytes);
  std::printf("KV on host         %10.2f MiB\n",
              static_cast<double>(st.host_bytes_reserved) / 1048576.0);
  std::printf("PCIe per token     %10.0f bytes   (h2d %lld, d2h %lld over %lld tokens)\n",
              static_cast<double>(st.bytes_h2d + st.bytes_d2h) / static_cast<double>(steps),
              static_cast<long long>(st.bytes_h2d), static_cast<long long>(st.bytes_d2h),
              static_cast<long long>(steps));
  std::printf("passkey            dense %d/%d, %s %d/%d\n", found_dense, total,
              lanes[0].label.c_str(), found_sparse, total);
  std::printf("total time         %10.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return Status::Ok();
}

Status Main(int argc, char** argv) {
  KVF_ASSIGN_OR_RETURN(Options o, ParseArgs(argc, argv));
  auto t0 = std::chrono::steady_clock::now();
  KVF_ASSIGN_OR_RETURN(Model model, LoadModel(o.model));
  std::unique_ptr<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    KVF_ASSIGN_OR_RETURN(tok, LoadLlama2cTokenizer(o.tokenizer, model.config.vocab_size));
  } else {
    KVF_ASSIGN_OR_RETURN(tok, LoadGgufTokenizer(o.model));
  }
  const ModelConfig& mc = model.config;
  std::fprintf(stderr, "[kvferry-llama] %s: %d layers, %d/%d heads, head_dim %d, vocab %d, "
               "loaded in %.1f s\n", mc.name.c_str(), mc.num_layers, mc.num_q_heads,
               mc.num_kv_heads, mc.head_dim, mc.vocab_size,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  Engine engine(model);
  // Matrix products follow the attention backend: cuBLAS when kvferry runs on CUDA.
  const bool want_gpu = o.base.backend == Backend::kCuda ||
                        (o.base.backend == Backend::kAuto && CudaAvailable());
  if (want_gpu) {
    const Status s = engine.UseGpuMatmul(o.base.device_id);
    if (!s.ok() && o.base.backend == Backend::kCuda) return s;
    std::fprintf(stderr, "[kvferry-llama] matrix products on %s\n",
                 engine.gpu_matmul() ? "the GPU (cuBLAS)" : "the CPU (oneDNN)");
  }
  std::ostringstream json;
  if (o.mode == "generate") return RunGenerate(o, engine, *tok, mc);
  if (o.mode == "perplexity") KVF_RETURN_IF_ERROR(RunPerplexity(o, engine, *tok, mc, json));
  if (o.mode == "passkey") KVF_RETURN_IF_ERROR(RunPasskey(o, engine, *tok, mc, json, nullptr, nullptr, nullptr));
  if (o.mode == "trace") KVF_RETURN_IF_ERROR(RunTrace(o, engine, *tok, model, json));
  if (o.mode == "report") KVF_RETURN_IF_ERROR(RunReport(o, engine, *tok, mc, json));
  if (!o.json_out.empty()) {
    std::ofstream out(o.json_out);
    out << json.str() << "\n";
    if (!out) return IoError(StrCat("cannot write ", o.json_out));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace kvferry::llama

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines show up when piped to a log
  const kvferry::Status st = kvferry::llama::Main(argc, argv);
  if (!st.ok()) {
    std::fprintf(stderr, "kvferry-llama: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
