#include "io/unicode.h"

#include <gtest/gtest.h>

namespace moeinfer::unicode {
namespace {

// Hangul composition follows Unicode's algorithm: an LV syllable takes a trailing consonant
// U+11A8..U+11C2, and U+11A7 (the trailing base, which is no consonant) stays apart.
TEST(UnicodeNormalize, HangulSyllableAndTrailingBaseStayApart) {
  const std::string lv_then_base = "\uC5B4\u11A7";
  for (NormalForm form : {NormalForm::kNFC, NormalForm::kNFKC}) {
    EXPECT_EQ(normalize(lv_then_base, form), lv_then_base);
    EXPECT_EQ(normalize("\u110B\u1165\u11A7", form), lv_then_base);  // L + V composes, T not
    EXPECT_EQ(normalize("\uC5B4\u11A8", form), "\uC5B5");            // a real T composes
  }
  EXPECT_EQ(normalize(lv_then_base, NormalForm::kNFD), "\u110B\u1165\u11A7");
}

}  // namespace
}  // namespace moeinfer::unicode
