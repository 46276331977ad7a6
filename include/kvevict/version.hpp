#pragma once

/// kvevict's version; CMake reads it from here.
#define KVEVICT_VERSION_MAJOR 0
#define KVEVICT_VERSION_MINOR 1
#define KVEVICT_VERSION_PATCH 0
