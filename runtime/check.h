// Copyright kvferry authors. Apache-2.0.
#pragma once
// Moved to base/check.h (the layer every folder may include); this forward goes away once no
// file includes it.
#include "base/check.h"
