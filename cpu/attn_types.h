// Copyright kvferry authors. Apache-2.0.
#pragma once
// Moved to base/attn_types.h (the layer every folder may include); this forward goes away once
// no file includes it.
#include "base/attn_types.h"
