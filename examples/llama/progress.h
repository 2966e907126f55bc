// Copyright kvferry authors. Apache-2.0.
#pragma once
// The progress lines live with the other tools' shared code (tools/common/progress.h); this
// header keeps the llama engine's includes and names working.
#include "tools/common/progress.h"

namespace kvferry::llama {
using tools::FormatDuration;
using tools::Progress;
}  // namespace kvferry::llama
