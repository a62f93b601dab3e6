// Training text for the tiny built-in tokenizer (see tokenizer_writer.hpp). Written for this project;
// changing it changes every tiny tokenizer's merges (and so the tiny models' token ids).
#include <string_view>

#include "tokenizer/tokenizer_writer.hpp"

namespace deltaserve::tokenizer {

std::string_view tiny_training_text() {
  static constexpr std::string_view kText =
      R"TEXT(The morning train to the coast was late again, and the station filled slowly with people who had
learned not to complain. A woman in a green coat read the timetable twice, as if the numbers might
change if she looked at them long enough. Somewhere behind her a child was counting the pigeons on
the roof: one, two, three, four, and then starting over whenever a bird flew away.

When the train finally arrived, nobody hurried. They stepped in, found their seats, and watched the
fields roll past the window. The conductor walked through the carriages and checked each ticket
with the same patient nod. "We'll be there by noon," he said, "if the weather holds." It didn't,
but they arrived anyway, a little after one o'clock, and the sea was grey and beautiful.

I've always thought that the best stories are the ones where nothing much happens. You're sitting
in a kitchen, the kettle is boiling, and someone tells you about their grandmother's garden. They'd
planted tomatoes, beans, and a row of sunflowers that grew taller than the fence. It's the kind of
detail you remember for years, long after the important conversations have faded.

Language models read text as a sequence of tokens. A tokenizer splits the input into pieces, maps
each piece to an integer, and the model predicts the next integer. Byte pair encoding starts from
single bytes and repeatedly merges the most frequent adjacent pair, so common words become single
tokens while rare words are spelled out from smaller parts. The same rules must be used for training
and for serving, or the model will see sequences it has never seen before.

The server accepts requests over HTTP, streams the generated text back as server-sent events, and
keeps the prompt cache warm between turns of a conversation. Latency is measured in milliseconds:
time to first token (TTFT), time per output token, and the total time of the request. In 2024 the
median request had 1,536 prompt tokens and 312 completion tokens; the 99th percentile was 65,536.

#include <cstdint>
#include <string>
#include <vector>

// Returns the sum of the values, or 0 for an empty vector.
int64_t sum_values(const std::vector<int64_t>& values) {
  int64_t total = 0;
  for (int64_t value : values) {
    total += value;
  }
  return total;
}

struct Request {
  std::string prompt;
  int32_t max_tokens = 256;
  double temperature = 0.7;
  bool stream = true;
};

def load_config(path: str) -> dict:
    """Read a JSON config file and return it as a dictionary."""
    with open(path, "r", encoding="utf-8") as f:
        config = json.load(f)
    if "hidden_size" not in config:
        raise ValueError(f"missing hidden_size in {path}")
    return config

for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.4f}")

{"model": "kimi-linear", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 128}

Поезд пришёл на станцию поздно вечером, когда уже стемнело и на платформе остались только самые
терпеливые пассажиры. Старик с газетой медленно поднялся со скамейки и посмотрел на часы. «Ничего,
— сказал он, — главное, что приехали». Его внучка засмеялась и взяла его за руку.

Модель читает текст как последовательность токенов. Токенизатор разбивает строку на части, и каждой
части соответствует число. Чем чаще встречается слово, тем больше шансов, что оно станет одним
токеном. Русские слова длиннее английских, поэтому для них нужно больше слияний.

Мы измеряем задержку в миллисекундах и пропускную способность в токенах в секунду. Сервер должен
отвечать быстро, даже если запросов много, а контекст длинный: сто тысяч токенов и больше.

今天早上的火车又晚点了，车站里慢慢地挤满了人。一位穿绿色外套的女士把时刻表看了两遍，好像多看几遍
数字就会改变。她身后有个孩子在数屋顶上的鸽子：一、二、三、四，每当有鸟飞走，他就重新开始数。

语言模型把文本看作一串词元。分词器把输入切成小块，再把每一块映射成一个整数，模型预测下一个整数。
字节对编码从单个字节开始，反复合并最常见的相邻字节对，所以常用的词会变成一个词元。

我们用毫秒来衡量延迟，用每秒词元数来衡量吞吐量。服务器需要在长上下文的情况下仍然快速响应。

Mixed lines happen in real chats: "Переведи, пожалуйста: 你好，世界 → Hello, world!" and the answer
comes back in three languages at once. Emoji too: 🙂 👍 🚀 — and symbols like ±, ×, ÷, €, £, ©, ™.

  Indented text, tabs	and	trailing spaces   
and numbers like 3.14159, 2.71828, 1e-5, 0x7fff, 127.0.0.1:8080, and 2025-11-03T12:34:56Z.

The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
She said she'd come; they've gone; we're here; I'm tired; you'll see; it's fine; he'd know.
)TEXT"
      "Windows files end their lines like this:\r\nfirst line\r\nsecond "
      "line\r\n\r\nand a blank one before.\r\n";
  return kText;
}

}  // namespace deltaserve::tokenizer
